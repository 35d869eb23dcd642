"""The connector's pure helpers, without servers: which device a rank opens."""

from __future__ import annotations

import pytest

kv = pytest.importorskip("kvpush.vllm", reason="the kvpush package (maturin develop) and vLLM")


@pytest.mark.parametrize(
    ("configured", "from_tensors", "expected"),
    [
        (None, "cuda:3", "cuda:3"),  # nothing configured: the rank's own GPU
        ("cuda", "cuda:3", "cuda:3"),  # "cuda" alone would open GPU 0 in every rank
        ("AUTO", "cuda:5", "cuda:5"),
        ("cuda:1", "cuda:3", "cuda:1"),  # an explicit ordinal is kept (the pointer check then decides)
        ("host", "cuda:3", "host"),
        (None, "host", "host"),
        ("cuda", "host", "cuda"),  # host tensors with "cuda" configured: the engine refuses them, clearly
        ("neuron", "host", "neuron"),
    ],
)
def test_device_spec_gives_each_rank_its_own_gpu(configured: str | None, from_tensors: str, expected: str) -> None:
    assert kv._device_spec(configured, from_tensors) == expected


def _vllm_config(kv_buffer_device: str | None) -> object:
    from types import SimpleNamespace

    ktc = SimpleNamespace(kv_connector_extra_config={}, kv_buffer_device=kv_buffer_device, engine_id="e")
    return SimpleNamespace(kv_transfer_config=ktc)


@pytest.mark.parametrize(("given", "kept"), [("cuda", "cuda"), ("cpu", "cpu"), (" CUDA ", "cuda")])
def test_kv_buffer_device_cuda_and_cpu_are_known(given: str, kept: str) -> None:
    assert kv.KVPushConfig.from_vllm(_vllm_config(given)).kv_buffer_device == kept


@pytest.mark.parametrize("given", ["xpu", "tpu", "gpu", "", None])
def test_unknown_kv_buffer_device_is_refused_with_the_known_ones(given: str | None) -> None:
    with pytest.raises(ValueError, match=r"kv_buffer_device .* not one it knows; known: cuda, cpu"):
        kv.KVPushConfig.from_vllm(_vllm_config(given))


def test_kv_buffer_device_must_be_where_the_kv_cache_is() -> None:
    kv._check_buffer_device("cuda", "cuda:1")
    kv._check_buffer_device("cpu", "host")
    with pytest.raises(ValueError, match="kv_buffer_device is 'cuda' but the KV cache is in host memory"):
        kv._check_buffer_device("cuda", "host")
    # "cpu" with a GPU cache: host staging (a host mirror moves), not a refusal.
    kv._check_buffer_device("cpu", "cuda:0")
    assert kv._stages_through_host("cpu", "cuda:0") and kv._stages_through_host("cpu", "cuda:3")
    assert not kv._stages_through_host("cpu", "host") and not kv._stages_through_host("cuda", "cuda:0")


def test_neuron_kv_cache_means_device_memory_and_libfabric() -> None:
    from kvpush import _neuron

    kv._check_buffer_device("cuda", "neuron")  # vLLM's "cuda": device memory, which Neuron HBM is
    with pytest.raises(ValueError, match="kv_buffer_device is 'cpu' but the KV cache is in Neuron device memory"):
        kv._check_buffer_device("cpu", "neuron")
    assert _neuron.backend(None, "neuron") == "LIBFABRIC"
    assert _neuron.backend(None, "cuda:0") == _neuron.backend(None, "host") == "UCX"
    assert _neuron.backend(" UCX ", "neuron") == "UCX", "a configured backend is kept"
    assert kv.KVPushConfig.from_vllm(_vllm_config("cuda")).nixl_backend is None, "unset: decided by the device"
