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
