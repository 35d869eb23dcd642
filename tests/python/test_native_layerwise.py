"""The native worker pushes layer by layer (issue #21): a producer reports each layer with
`layers_ready`, over NIXL and the side channel between two workers of this process, and the
consumer's blocks hold exactly the producer's bytes once it has received; nothing is received before
the last layer. An unknown `layerwise` setting is refused. Skips without NIXL (fails under CI=true:
conftest.py turns skips into failures there)."""

from __future__ import annotations

import ctypes
import time

import pytest

kvpush = pytest.importorskip("kvpush", reason="the kvpush package (maturin develop)")

LAYERS, BLOCKS, BLOCK_TOKENS, HEAD_DIM = 4, 8, 16, 8
BLOCK_BYTES = 2 * BLOCK_TOKENS * HEAD_DIM * 2  # K and V, one head, float16
REGION = BLOCKS * BLOCK_BYTES


def worker(name: str, buf: ctypes.Array, **extra: object) -> object:
    base = ctypes.addressof(buf)
    config = {
        "engine_id": name,
        "mode": "push",
        "dtype": "float16",
        "placement": "joint",
        "total_layers": LAYERS,
        "kv_heads": 1,
        "head_dim": HEAD_DIM,
        "block_tokens": BLOCK_TOKENS,
        "num_blocks": BLOCKS,
        "groups": [(list(range(LAYERS)), 0)],
        "region_bases": [base + i * REGION for i in range(LAYERS)],
        "region_lens": [REGION] * LAYERS,
        "side_channel_host": "127.0.0.1",
        "side_channel_port": 0,
        "device": "host",
        "insecure": True,
    }
    config.update(extra)
    return kvpush.Worker(config)


def wait_for(w: object, kind: str, seen: list, limit: float = 20.0) -> tuple:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        seen.extend(w.poll())
        for o in seen:
            if o[0] == kind:
                return o
        time.sleep(0.002)
    pytest.fail(f"no {kind!r} within {limit} s; saw {seen}")


def test_layers_ready_pushes_every_layer_and_every_byte() -> None:
    if not kvpush.nixl_available():
        pytest.skip("NIXL is not available (libnixl_capi.so): run scripts/nixl.sh / scripts/python.sh")
    p_buf = ctypes.create_string_buffer(LAYERS * REGION)
    d_buf = ctypes.create_string_buffer(LAYERS * REGION)
    # P's KV: a pattern that differs per byte, layer and block.
    for i in range(LAYERS * REGION):
        p_buf[i] = (i * 7 + i // 251) % 256
    p = worker("prefill-lw", p_buf, layerwise="on")
    d = worker("decode-lw", d_buf)
    tid, tokens = "%032x" % 0x21, 40  # 3 blocks
    src, dst = [[0, 1, 2]], [[5, 6, 7]]
    d.blocks_allocated(tid, 1, "prefill-lw", "127.0.0.1", p.side_channel_port, 1, dst, tokens)
    seen_d: list = []
    for layer in range(LAYERS):
        seen_d.extend(d.poll())
        assert not [o for o in seen_d if o[0] == "received"], f"received before layer {layer}: {seen_d}"
        p.layers_ready(tid, 1, src, tokens, layer, layer + 1)
        if layer == 0:
            time.sleep(0.2)  # let the registration reach P: later layers then go one by one
    wait_for(d, "received", seen_d)
    wait_for(p, "sent", [])
    for layer in range(LAYERS):
        for n, (s, t) in enumerate(zip(src[0], dst[0])):
            want = p_buf.raw[layer * REGION + s * BLOCK_BYTES : layer * REGION + (s + 1) * BLOCK_BYTES]
            got = d_buf.raw[layer * REGION + t * BLOCK_BYTES : layer * REGION + (t + 1) * BLOCK_BYTES]
            if n < 2:
                assert got == want, f"layer {layer}, block {s} -> {t} differs"
            else:
                # The last block holds tokens 32..40 of 16: only those 8 tokens' K and V move.
                half = BLOCK_TOKENS * HEAD_DIM * 2
                part = 8 * HEAD_DIM * 2
                assert got[:part] == want[:part] and got[half : half + part] == want[half : half + part]
    counters = p.stats()["counters"]
    assert counters["posts"] >= 2, counters  # at least layer 0 and one later layer posted apart


def test_an_unknown_layerwise_setting_is_refused() -> None:
    buf = ctypes.create_string_buffer(LAYERS * REGION)
    with pytest.raises(kvpush.ConfigError, match="layerwise"):
        worker("bad-lw", buf, layerwise="sometimes")


def test_layers_ready_serves_only_the_consumer_it_names() -> None:
    # The router names D; the vLLM connector passes it on with every layer (consumer_engine_id). A
    # registration from another engine is refused and its blocks are never written.
    if not kvpush.nixl_available():
        pytest.skip("NIXL is not available (libnixl_capi.so): run scripts/nixl.sh / scripts/python.sh")
    p_buf = ctypes.create_string_buffer(b"\x5a" * (LAYERS * REGION))
    d_buf = ctypes.create_string_buffer(LAYERS * REGION)
    p = worker("prefill-lc", p_buf, layerwise="on")
    d = worker("decode-lc", d_buf)
    tid, tokens = "%032x" % 0x22, 32
    d.blocks_allocated(tid, 1, "prefill-lc", "127.0.0.1", p.side_channel_port, 1, [[4, 5]], tokens)
    time.sleep(0.2)  # the registration reaches P first
    for layer in range(LAYERS):
        p.layers_ready(tid, 1, [[0, 1]], tokens, layer, layer + 1, consumer_engine_id="decode-elsewhere")
    kind = wait_for(d, "failed", [])[0]
    assert kind == "failed"
    assert d_buf.raw == bytes(LAYERS * REGION), "a refused consumer's blocks were written"
