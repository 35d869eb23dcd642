"""A harness shaped like vllm-neuron 0.24's worker, over the fake libnrt (tests/neuron_fake), for the connector.

What vllm-neuron does, in its order (vllm_neuron/vllm/worker/neuron_worker.py,
``_init_neuron_distributed_environment_and_runtime``, then the model runner's KV cache set-up):

1. one visible NeuronCore per worker: ``NEURON_RT_VISIBLE_CORES=<core>``; ``NEURON_RT_MAP_HBM=1`` ("required
   for RDMA in disaggregated inference");
2. vLLM's distributed state (here: rank 0 of 1, as :func:`single_rank` patches it);
3. the runtime initialised (``torch.classes.neuron.Runtime().initialize()``; here :class:`Runtime`, ``nrt_init``
   with the PyTorch framework type) *before* any KV transfer is set up;
4. the KV cache: one device tensor per attention layer, named as vLLM names layers
   (``model.layers.<i>.self_attn.attn``), shaped ``(2, blocks, heads, block_size, head_dim)``, on torch device
   ``neuron``, whose ``data_ptr()`` is the device virtual address (``nrt_tensor_get_va``);
5. ``ensure_kv_transfer_initialized`` → the connector's ``register_kv_caches(kv_caches)``.

Without torch-neuronx no real tensor can live on device ``neuron``: :class:`NeuronTensor` is a CPU tensor over
the fake's device memory (which the fake maps into the process, as ``NEURON_RT_MAP_HBM=1`` makes the real
runtime do) that reports device ``neuron:<core>``, as a torch-neuronx tensor does. Its memory is the
framework's: the engine never saw an ``nrt_tensor_t*`` and must accept it through libnrt.

The fake libnrt is compiled here with the C compiler, with the flags kvpush_testkit::neuron_fake uses.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
FAKE_SRC = REPO / "tests" / "neuron_fake"

# nrt.h: NRT_FRAMEWORK_TYPE_PYTORCH, NRT_TENSOR_PLACEMENT_DEVICE.
_FRAMEWORK_PYTORCH = 3
_PLACEMENT_DEVICE = 0

class FullAttentionSpec:
    """Stands for vLLM's spec of a full-attention layer (the connector goes by the spec's type name)."""

    sliding_window = None



def build_fake(out_dir: Path) -> Path:
    """Compiles tests/neuron_fake/fake_nrt.c into ``out_dir``; a missing compiler raises (the caller fails)."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise FileNotFoundError(f"the C compiler {cc!r} is not on PATH (set CC)")
    out = out_dir / "libfake_nrt-full.so"
    cmd = [cc, "-shared", "-fPIC", "-O1", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", str(FAKE_SRC / "include"),
           str(FAKE_SRC / "fake_nrt.c"), "-o", str(out), "-lpthread"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


class Runtime:
    """The framework's Neuron runtime (torch-neuronx's ``Runtime``) over a libnrt: the library loaded
    globally, ``nrt_init`` once, device tensors allocated and freed by the framework."""

    def __init__(self, library: Path):
        self.path = library
        self.lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        self.lib.nrt_init.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]
        self.lib.nrt_tensor_allocate.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
        ]  # fmt: skip
        self.lib.nrt_tensor_get_va.argtypes = [ctypes.c_void_p]
        self.lib.nrt_tensor_get_va.restype = ctypes.c_void_p
        self.lib.nrt_tensor_free.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.lib.fake_nrt_get.argtypes = [ctypes.c_char_p]
        self.lib.fake_nrt_get.restype = ctypes.c_long
        self.tensors: list[ctypes.c_void_p] = []

    def initialize(self) -> None:
        assert os.environ.get("NEURON_RT_MAP_HBM") == "1", "vllm-neuron sets NEURON_RT_MAP_HBM=1 before the runtime"
        status = self.lib.nrt_init(_FRAMEWORK_PYTORCH, b"2.9", b"")
        assert status == 0, f"nrt_init failed with status {status}"

    def allocate(self, nbytes: int, name: str, core: int) -> int:
        """A device tensor of ``nbytes`` on ``core``; returns its device virtual address."""
        handle = ctypes.c_void_p()
        status = self.lib.nrt_tensor_allocate(_PLACEMENT_DEVICE, core, nbytes, name.encode(), ctypes.byref(handle))
        assert status == 0, f"nrt_tensor_allocate({name}) failed with status {status}"
        self.tensors.append(handle)
        va = self.lib.nrt_tensor_get_va(handle)
        assert va, "nrt_tensor_get_va returned NULL: NEURON_RT_MAP_HBM is not in effect"
        return int(va)

    def counter(self, name: str) -> int:
        return int(self.lib.fake_nrt_get(name.encode()))

    def free_all(self) -> None:
        for h in self.tensors:
            self.lib.nrt_tensor_free(ctypes.byref(h))
        self.tensors.clear()

    def close(self) -> None:
        self.free_all()
        self.lib.nrt_close()


@dataclass(frozen=True)
class NeuronDev:
    """``torch.device("neuron", core)`` as torch-neuronx reports it."""

    index: int
    type: str = "neuron"

    def __str__(self) -> str:
        return f"{self.type}:{self.index}"


class NeuronTensor:
    """A KV cache tensor on device ``neuron`` (see the module docs): a view of device memory mapped into the
    process, reporting device ``neuron:<core>``; indexing gives the same kind of tensor."""

    def __init__(self, t: torch.Tensor, core: int):
        self._t, self.device = t, NeuronDev(core)

    @classmethod
    def over(cls, va: int, shape: tuple[int, ...], dtype: torch.dtype, core: int) -> NeuronTensor:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        raw = (ctypes.c_uint8 * nbytes).from_address(va)
        return cls(torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape), core)

    is_cuda = False

    def __getitem__(self, i: Any) -> NeuronTensor:
        return NeuronTensor(self._t[i], self.device.index)

    def __getattr__(self, name: str) -> Any:  # shape, stride, dtype, element_size, data_ptr
        return getattr(self._t, name)

    def host_view(self) -> torch.Tensor:
        """The mapped memory (what the real runtime's NEURON_RT_MAP_HBM mapping shows the CPU)."""
        return self._t


@dataclass
class Model:
    """A small model's KV geometry (Llama-shaped names; vllm-neuron's KV layout)."""

    layers: int = 3
    kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 32
    blocks: int = 12
    dtype: torch.dtype = torch.bfloat16

    def layer_name(self, i: int) -> str:
        return f"model.layers.{i}.self_attn.attn"

    def shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.blocks, self.kv_heads, self.block_size, self.head_dim)


def allocate_kv_caches(rt: Runtime, model: Model, core: int, engine: str) -> dict[str, NeuronTensor]:
    """Step 4: one device tensor per layer, as vllm-neuron's model runner allocates its KV cache."""
    elem = torch.empty((), dtype=model.dtype).element_size()
    nbytes = 2 * model.blocks * model.kv_heads * model.block_size * model.head_dim * elem
    out = {}
    for i in range(model.layers):
        name = model.layer_name(i)
        va = rt.allocate(nbytes, f"{engine}.{name}", core)
        out[name] = NeuronTensor.over(va, model.shape(), model.dtype, core)
    return out


def vllm_config(model: Model, engine_id: str, extra: dict[str, Any], kv_buffer_device: str = "cuda") -> Any:
    """The parts of a VllmConfig the connector's worker half reads, as vllm-neuron 0.24 fills them."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            engine_id=engine_id, kv_connector_extra_config=extra, kv_buffer_device=kv_buffer_device
        ),
        model_config=SimpleNamespace(
            get_total_num_kv_heads=lambda: model.kv_heads,
            get_head_size=lambda: model.head_dim,
            hf_config=SimpleNamespace(num_hidden_layers=model.layers),
            use_mla=False,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=model.block_size),
    )


def kv_cache_config(model: Model) -> Any:
    layer_names = [model.layer_name(i) for i in range(model.layers)]
    group = SimpleNamespace(layer_names=layer_names, kv_cache_spec=FullAttentionSpec())
    return SimpleNamespace(kv_cache_groups=[group], num_blocks=model.blocks)


def single_rank(monkeypatch: Any) -> None:
    """Step 2 for one rank of one: vLLM's parallel state as vllm-neuron's distributed init leaves it."""
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))


def pattern(req: int, layer: int, kv: int, block: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic bytes for one (layer, K or V, block) of request ``req``."""
    n = 1
    for s in shape:
        n *= s
    base = (req * 131 + layer * 31 + kv * 17 + block * 7) % 251
    return ((torch.arange(n, dtype=torch.int64) * 3 + base) % 251 + 1).to(torch.uint8).view(shape)
