"""The memory offer (docs/deployment.md §4, the host bounce) from the connector's config to the native
worker, without servers: the connector passes a string on, the engine parses it at start-up."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
from host_worker import block_bytes, host_config

kvpush = pytest.importorskip("kvpush", reason="the kvpush package (maturin develop)")
kv = pytest.importorskip("kvpush.vllm", reason="the kvpush package (maturin develop) and vLLM")

SHAPE = dict(layers=2, blocks=4, block_tokens=16, head_dim=8)


def _vllm_config(**extra: object) -> object:
    ktc = SimpleNamespace(kv_connector_extra_config=extra, kv_buffer_device="cuda", engine_id="e")
    return SimpleNamespace(kv_transfer_config=ktc)


def test_the_connector_keeps_the_offer_and_refuses_a_non_string() -> None:
    assert kv.KVPushConfig.from_vllm(_vllm_config()).memory_offer is None
    cfg = kv.KVPushConfig.from_vllm(_vllm_config(memory_offer="neuron,device=none"))
    assert cfg.memory_offer == "neuron,device=none"
    with pytest.raises(ValueError, match="memory_offer must be a string"):
        kv.KVPushConfig.from_vllm(_vllm_config(memory_offer={"kind": "neuron"}))


def test_a_worker_starts_with_an_offer_and_a_bad_one_is_refused_naming_the_format() -> None:
    buf = ctypes.create_string_buffer(SHAPE["layers"] * SHAPE["blocks"] * block_bytes(16, 8))
    worker = kvpush.Worker(host_config("offer-ok", buf, memory_offer="host", **SHAPE))
    assert worker.stats()["counters"]["registrations"] == 0
    for bad, why in [("tpu", "unknown memory kind"), ("neuron,device=fly", "unknown operations")]:
        with pytest.raises(kvpush.ConfigError, match=why) as e:
            kvpush.Worker(host_config("offer-bad", buf, memory_offer=bad, **SHAPE))
        assert "KIND[,device=OPS][,host=OPS]" in str(e.value)
