"""benches/connector_layouts.py on host tensors, its CI setting (``--fast``): the connector's worker half
(``register_kv_caches``, the metadata ``start_load_kv`` consumes, ``get_finished``) between a P and a D
process, for every backend layout, push and pull, every byte of both caches checked by the driver. On
the H200 the same driver runs on CUDA tensors (scripts/gpu_check.sh; results in docs/vllm.md). The
first test uses vLLM's own modules; the others the stand-ins the GPU machine uses (and start faster).

``kv_buffer_device=cpu`` host staging takes its GPU path here with ``--forced-staging`` (host tensors
stand in for the GPU's): the engine must register the host mirror and never the cache, D's cache must
be untouched until the copy to it, and the copies must name exactly the request's blocks.

The expected bytes are worked out here from the geometry (the driver's ``FAST``), not read from it.
Skips without NIXL or vLLM's stand-ins' parts (fails under CI=true: conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

kvpush = pytest.importorskip("kvpush", reason="the kvpush package (maturin develop)")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "benches" / "connector_layouts.py"

# The driver's FAST geometry, restated: 3 layers, 2 heads, head size 16, 16-token blocks, float16.
LAYERS, HEADS, D, N, ES = 3, 2, 16, 16, 2
LENGTHS = [1, 15, 16, 53, 100]
BLOCKS = sum(-(-n // N) for n in LENGTHS)  # 16-token blocks (kernel blocks where they are smaller)
KV_BLOCK = 2 * N * HEADS * D * ES  # K and V of one block of one layer
MLA_BLOCK = N * 576 * 2  # one bfloat16 latent vector of 576 per token
LAYOUTS = {
    "flash_attn_nhd": KV_BLOCK, "flash_attn_hnd": KV_BLOCK, "flashinfer_nhd": KV_BLOCK,
    "flashinfer_hnd": KV_BLOCK, "triton": KV_BLOCK, "pages_lbhnc": KV_BLOCK, "pages_lbnhc": KV_BLOCK,
    "mla_latent": MLA_BLOCK, "kernel_blocks": KV_BLOCK, "kernel_blocks_mixed": KV_BLOCK, "cpu_attn": KV_BLOCK,
}  # fmt: skip


def drive(tmp_path: Path, *args: str, name: str = "rows") -> tuple[int, str, list[dict[str, Any]]]:
    if not kvpush.nixl_available():
        pytest.skip("NIXL is not available (libnixl_capi.so): run scripts/nixl.sh / scripts/python.sh")
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(DRIVER), "--device", "cpu", "--fast", "--json", str(out), *args],
        capture_output=True, text=True, timeout=1200, cwd=ROOT,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert out.exists(), text[-4000:]
    return proc.returncode, text, json.loads(out.read_text())["rows"]


def test_every_layout_moves_every_byte_between_two_processes(tmp_path: Path) -> None:
    rc, text, rows = drive(tmp_path)
    assert rc == 0, text[-4000:]
    assert "vLLM: its own modules" in text, "the first test drives the worker half with vLLM's own modules"
    seen = {(r["layout"], r["mode"]) for r in rows}
    assert seen == {(lay, mode) for lay in LAYOUTS for mode in ("push", "pull")}, text[-2000:]
    for r in rows:
        # Pull with kernel blocks too (P's vLLM ids expanded by D's engine with P's kernel block size;
        # kernel_blocks_mixed: P's vLLM blocks of 4 kernel blocks, D's of 2): nothing is refused.
        assert r["ok"] and "refused" not in r, r
        # Host tensors, kv_buffer_device cpu: the engine registers the cache itself.
        assert (r["buffer"], r["registered_p"], r["registered_d"], r["engine_device"]) == ("cpu", "cache", "cache", "host"), r
        assert r["blocks"] == BLOCKS and r["bytes"] == BLOCKS * LAYERS * LAYOUTS[r["layout"]], r
        assert r["wrong_bytes_d"] == r["wrong_bytes_p"] == 0 and r["reported_p"] == r["reported_d"] == len(LENGTHS), r
    assert f"connector_layouts: {len(rows)}/{len(rows)} passed on cpu" in text


def test_kv_buffer_device_cpu_moves_the_host_mirror(tmp_path: Path) -> None:
    layouts = ["flash_attn_hnd", "pages_lbnhc", "mla_latent", "kernel_blocks", "kernel_blocks_mixed"]
    rc, text, rows = drive(tmp_path, "--vllm", "stand-ins", "--forced-staging", "--layouts", ",".join(layouts))
    assert rc == 0, text[-4000:]
    assert "vLLM: minimal stand-ins" in text
    for r in rows:
        assert r["ok"], r
        assert (r["registered_p"], r["registered_d"], r["engine_device"]) == ("mirror", "mirror", "host"), r
        # D's cache held only its own bytes when the copy to it began; afterwards P's: only the copy
        # can have put them there.
        assert r["cache_untouched_at_h2d"] is True and r["wrong_bytes_d"] == 0, r
        # One copy per request, each side its own direction, covering exactly the moved blocks.
        assert [d for d, _ in r["copies_p"]] == ["d2h"] * len(LENGTHS), r
        assert [d for d, _ in r["copies_d"]] == ["h2d"] * len(LENGTHS), r
        assert sum(n for _, n in r["copies_p"]) == sum(n for _, n in r["copies_d"]) == BLOCKS, r
        assert r["bytes"] == BLOCKS * LAYERS * LAYOUTS[r["layout"]], r
    assert {(r["layout"], r["mode"]) for r in rows} == {(lay, m) for lay in layouts for m in ("push", "pull")}


def test_the_byte_check_sees_one_changed_element(tmp_path: Path) -> None:
    # The control: D changes one element (2 bytes) of its cache after the transfer; every row fails.
    rc, text, rows = drive(tmp_path, "--vllm", "stand-ins", "--control-corrupt", "--layouts", "flash_attn_nhd,mla_latent",
                           "--modes", "push")  # fmt: skip
    assert rc == 1, text[-4000:]
    assert len(rows) == 2 and all(not r["ok"] and r["wrong_bytes_d"] == 2 for r in rows), rows
    assert all(r["failed_checks"] == ["D's cache: P's bytes in the target blocks, its own elsewhere"] for r in rows), rows


def test_layerwise_hands_each_layer_over_from_save_kv_layer(tmp_path: Path) -> None:
    # Layer-wise push through the connector's hooks (save_kv_layer per layer, then wait_for_save), D
    # registered first: P's layers leave one by one, every byte lands. On the H200 the same rows run
    # on CUDA with the event feeder (scripts/gpu_check.sh, connector-layerwise).
    layouts = ["flash_attn_hnd", "mla_latent", "kernel_blocks"]
    rc, text, rows = drive(tmp_path, "--vllm", "stand-ins", "--modes", "layerwise", "--layouts", ",".join(layouts))
    assert rc == 0, text[-4000:]
    assert [r["layout"] for r in rows] == layouts and all(r["mode"] == "layerwise" for r in rows), rows
    for r in rows:
        assert r["ok"] and r["wrong_bytes_d"] == r["wrong_bytes_p"] == 0, r
        assert r["bytes"] == BLOCKS * LAYERS * LAYOUTS[r["layout"]], r
        # One post per layer per request at most (what was final together may go together), and
        # more than one per request: the layers did not wait for the whole prompt.
        assert len(LENGTHS) < r["posts_p"] <= LAYERS * len(LENGTHS), r
