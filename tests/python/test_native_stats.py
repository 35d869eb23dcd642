"""The native worker's statistics reach Python whole: nested counters, failures and latencies, with
the names the C header gives them (cpp/include/kvpush.h is the oracle, not the Rust code)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

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


def host_worker(engine_id: str) -> tuple[Any, Any]:
    """A push-mode worker over host memory (and the buffer, which must outlive it)."""
    blocks, block_tokens, head_dim, layers = 4, 16, 8, 2
    buf = ctypes.create_string_buffer(layers * blocks * block_bytes(block_tokens, head_dim))
    shape = dict(layers=layers, blocks=blocks, block_tokens=block_tokens, head_dim=head_dim)
    worker = kvpush.Worker(host_config(engine_id, buf, **shape))
    return worker, buf


def test_request_finished_takes_an_optional_consumer_engine_id() -> None:
    worker, _buf = host_worker("consumer-test")
    key = "ab" * 16
    worker.request_finished(key, 1, [[0, 1]], 32)  # the old call
    worker.request_finished(key, 2, [[0, 1]], 32, consumer_engine_id="decode-1")
    worker.request_finished(key, 3, [[0, 1]], 32, consumer_engine_id=None)
    for bad in ("", "d" * 257):
        with pytest.raises(kvpush.KvpushError, match="consumer engine id"):
            worker.request_finished(key, 4, [[0, 1]], 32, consumer_engine_id=bad)


def test_stats_are_nested_with_the_headers_names() -> None:
    worker, _buf = host_worker("stats-test")
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
