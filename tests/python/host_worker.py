"""A native worker's config over host memory the test owns: the keys every server-less test of
``kvpush.Worker`` needs (one float16 KV head, joint K/V, one group), on loopback with port 0."""

from __future__ import annotations

import ctypes
from typing import Any


def block_bytes(block_tokens: int, head_dim: int) -> int:
    """Bytes of one block of one layer: K and V, one head, float16."""
    return 2 * block_tokens * head_dim * 2


def host_config(
    engine_id: str, buf: ctypes.Array, *, layers: int, blocks: int, block_tokens: int, head_dim: int, **extra: Any
) -> dict[str, Any]:
    """The config of a push worker whose `layers` regions of `blocks` blocks lie one after the other in
    `buf`; `extra` keys are added (or replace the defaults)."""
    base, per_block = ctypes.addressof(buf), block_bytes(block_tokens, head_dim)
    config: dict[str, Any] = {
        "engine_id": engine_id,
        "mode": "push",
        "dtype": "float16",
        "placement": "joint",
        "total_layers": layers,
        "kv_heads": 1,
        "head_dim": head_dim,
        "block_tokens": block_tokens,
        "num_blocks": blocks,
        "groups": [(list(range(layers)), 0)],
        "region_bases": [base + i * blocks * per_block for i in range(layers)],
        "region_lens": [blocks * per_block] * layers,
        "side_channel_host": "127.0.0.1",
        "side_channel_port": 0,
        "device": "host",
    }
    config.update(extra)
    return config
