"""The connector on AWS Neuron (vllm-neuron 0.24): which device a KV cache is on, what ``kv_buffer_device``
means there, and the NIXL backend it defaults to.

Read :func:`tensor_device` first. vllm-neuron's worker starts the Neuron runtime (one visible NeuronCore
per worker, ``NEURON_RT_VISIBLE_CORES``, with ``NEURON_RT_MAP_HBM=1``) before the KV cache is allocated,
then hands the connector one tensor per attention layer on torch device ``neuron`` (torch-neuronx's
name for PyTorch's ``privateuseone``), shaped ``(2, blocks, heads, block_size, head_dim)``; each tensor's
``data_ptr()`` is its device virtual address, which the engine's ``neuron`` device validates through
libnrt (src/device/neuron.rs) and registers as VRAM. As for vLLM's own NixlConnector on Neuron,
``kv_buffer_device`` is ``cuda`` ("device memory") and ``cpu`` is refused, and the NIXL backend defaults
to ``LIBFABRIC`` (UCX has no Neuron memory type).

Pure Python with no vLLM or torch-neuronx import; tests/python/test_neuron_harness.py drives it.
This module never touches a tensor's memory.
"""

from __future__ import annotations

from typing import Any

# torch device types of Neuron tensors: torch-neuronx renames privateuseone to "neuron".
NEURON_DEVICE_TYPES = ("neuron", "privateuseone")

# The engine device name and the NIXL backend on Neuron.
DEVICE = "neuron"
BACKEND = "LIBFABRIC"
# Where no device says otherwise.
DEFAULT_BACKEND = "UCX"


def is_neuron(device: Any) -> bool:
    """Whether a torch device (or its string) is a Neuron device."""
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    return kind in NEURON_DEVICE_TYPES


def tensor_device(t: Any) -> str:
    """The engine's name for the memory ``t`` is in: ``cuda:<index>``, ``neuron`` or ``host``."""
    if getattr(t, "is_cuda", False):
        return f"cuda:{t.device.index}"
    if is_neuron(t.device):
        return DEVICE
    return "host"


def check_buffer_device(kv_buffer_device: str) -> None:
    """On Neuron, ``kv_buffer_device`` must be ``cuda``: vLLM's convention for device memory, which the
    KV cache in HBM is. ``cpu`` (a host buffer the cache is staged through) is refused, as vLLM's
    NixlConnector refuses it on Neuron."""
    if kv_buffer_device != "cuda":
        raise ValueError(
            f"kvpush: kv_buffer_device is {kv_buffer_device!r} but the KV cache is in Neuron device memory "
            "(HBM, registered as device memory over EFA): set kv_buffer_device to 'cuda', which on Neuron "
            "means device memory, as for vLLM's NixlConnector"
        )


def backend(configured: str | None, from_tensors: str) -> str:
    """The NIXL backend: the configured one, else ``LIBFABRIC`` for a Neuron KV cache, ``UCX`` otherwise."""
    if configured is not None and str(configured).strip():
        return str(configured).strip()
    return BACKEND if from_tensors == DEVICE else DEFAULT_BACKEND
