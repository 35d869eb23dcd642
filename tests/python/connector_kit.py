"""What the server-less connector tests share: the connector's settings and the slice of vLLM's config
its halves read, as plain objects (tests/python/test_connector_*.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import kvpush.vllm as kv


def config(**over: Any) -> kv.KVPushConfig:
    """The connector's settings (push, insecure, engine defaults); ``over`` replaces fields."""
    cfg = kv.KVPushConfig(
        mode="push", side_channel_host="127.0.0.1", side_channel_listen="0.0.0.0", side_channel_port=5600,
        nixl_backend="UCX", lease_ms=0, timeout_ms=0, peer_timeout_ms=15000, writers=1, secret=None,
        insecure=True, device=None, staging="auto",
    )  # fmt: skip
    return dataclasses.replace(cfg, **over)


def vllm_config(engine_id: str, block_size: int = 16) -> SimpleNamespace:
    """What the scheduler and worker halves read of vLLM's config."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=engine_id),
        cache_config=SimpleNamespace(block_size=block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )


def worker(native: Any, blocks_per_block: int = 1, kernel_tokens: int = 16) -> kv._Worker:
    """A worker half whose engine is ``native`` (a fake recording calls), with kernel blocks of
    ``kernel_tokens`` tokens, ``blocks_per_block`` to a vLLM block, as ``register_kv_caches`` would set."""
    w = kv._Worker(vllm_config("engine-0"), None, config())
    w.native, w.blocks_per_block, w.kernel_tokens = native, blocks_per_block, kernel_tokens
    return w
