"""The native worker's statistics reach Python whole: nested counters, failures and latencies, with
the names the C header gives them (cpp/include/kvpush.h is the oracle, not the Rust code)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
from host_worker import block_bytes, host_config

kvpush = pytest.importorskip("kvpush", reason="the kvpush package (maturin develop)")

HEADER = Path(__file__).resolve().parents[2] / "cpp" / "include" / "kvpush.h"


def header_fields(struct: str) -> list[str]:
    """The field names of `typedef struct <struct> { ... } <struct>;` in kvpush.h."""
    text = HEADER.read_text()
    body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (struct, struct), text, re.S)
    assert body, f"{struct} not in {HEADER}"
    code = re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S)
    names = []
    for decl in code.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        _, _, rest = decl.partition(" ")
        names += [n.strip().lstrip("*") for n in rest.split(",")]
    return names


def test_stats_are_nested_with_the_headers_names() -> None:
    blocks, block_tokens, head_dim, layers = 4, 16, 8, 2
    buf = ctypes.create_string_buffer(layers * blocks * block_bytes(block_tokens, head_dim))
    shape = dict(layers=layers, blocks=blocks, block_tokens=block_tokens, head_dim=head_dim)
    worker = kvpush.Worker(host_config("stats-test", buf, **shape))
    stats = worker.stats()
    assert sorted(stats["counters"]) == sorted(header_fields("kvpush_counters"))
    assert sorted(stats["failures"]) == sorted(header_fields("kvpush_failures"))
    assert all(v == 0 for v in stats["counters"].values()), stats["counters"]
    latency = set(header_fields("kvpush_latency"))
    for name in header_fields("kvpush_stats"):
        if name in ("counters", "failures"):
            continue
        assert latency <= set(stats[name]), (name, stats[name])
        assert stats[name]["count"] == 0
