"""The connector's worker half on KV caches laid out as each attention backend lays them out, P and D as
two processes, every byte checked (issue #17: "CUDA layouts on the H200").

    python benches/connector_layouts.py --device cuda            # on a GPU (the H200 run)
    python benches/connector_layouts.py --device cpu --fast      # CI (tests/python/test_connector_layouts_driver.py)

For each layout (FlashAttention NHD and HND, FlashInfer NHD and HND, Triton, vLLM 0.3x pages LBHNC and
LBNHC, MLA latent, kernel blocks smaller than vLLM's block, vLLM CPU), each ``kv_buffer_device``
(``cuda``: the engine moves the cache itself; ``cpu``: it moves a host mirror, filled and emptied by
vLLM's block copy, docs/vllm.md) and each mode (push, pull), a P process and a D process each build
their per-layer KV cache tensors on ``--device`` (shapes and strides as the backend makes them, random
bytes from a seed), start ``kvpush.vllm._Worker`` on them (``register_kv_caches``, then
``set_host_xfer_buffer_ops`` as vLLM's model runner does), and are driven through the scheduler
metadata ``start_load_kv`` consumes (P: ``Finished``, D: ``Receive`` with P's side-channel port) for a
few requests of various lengths on fragmented block ids, polling ``get_finished`` until every request
is reported. D then checks every byte of its cache: the target blocks hold P's bytes, every other
block its own; P checks its cache is unchanged. With a host mirror, D also checks that the engine
registered the mirror (not the cache), that its cache was untouched when the copy to it began, and
that the copies named exactly the request's blocks.

Mode ``layerwise`` (``--modes layerwise``; push with the connector's ``layerwise`` on, issue #21): D
registers first, then P runs the forward pass as vLLM does with a layer-wise connector: per layer, the
layer's KV is written (until then P's cache holds other bytes), then ``save_kv_layer``, and
``wait_for_save`` after the last. On CUDA each layer's write waits behind a GPU sleep of ~10 ms, so only
a feeder that waits for the layer's event hands the engine written blocks; the row checks every byte,
that P posted layers separately, and that the hooks' host time stayed under a quarter of the GPU's
(the forward pass never waited for the host). ``--control-no-wait`` makes the feeder skip the wait:
every layer-wise row on CUDA must then fail.

With kernel blocks smaller than vLLM's block, D's ``Receive`` names P's vLLM block ids and P's vLLM block
size (``remote_block_size``, as P's scheduler half puts it in ``kv_transfer_params``): D's engine expands
them to P's kernel blocks with the kernel block size P published at the handshake. Layout
``kernel_blocks_mixed`` gives P and D different ratios (P: 64-token vLLM blocks of 16-token kernel
blocks, D: 32-token blocks of the same kernel blocks). vLLM CPU's layout is host-only: it runs on host tensors
whatever ``--device`` says.

vLLM need not be installed: ``kvpush.vllm`` imports vLLM's connector base, metrics and logger at
module level, and ``register_kv_caches`` imports vLLM's parallel state and ``extract_layer_index``;
where vLLM is absent (the GPU machine) the driver installs minimal stand-ins for exactly those five
modules, and says so. The block copy handed to ``set_host_xfer_buffer_ops`` is the driver's, doing
what vLLM's ``copy_kv_blocks`` does on CUDA (``dst[ids] = src[ids]`` per region).

Prints a table (layout × buffer × mode: bytes, verified, seconds) and a summary line starting with
``connector_layouts:``; ``--json PATH`` writes every row. Exits 1 unless every row passed.
"""

from __future__ import annotations

import argparse
import enum
import gc
import json
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

SEED = 0x17C0DA
INT = torch.int16  # every dtype used here is 2 bytes: compared as integers, bit for bit (NaN included)


# ---- vLLM, or the least of it

class FullAttentionSpec:
    """Stands for vLLM's spec of a full-attention layer (the connector goes by the spec's type name)."""

    sliding_window = None



def install_vllm_stand_ins(force: bool = False) -> bool:
    """Without vLLM (or with ``force``): stand-ins for the five vLLM modules kvpush.vllm's worker half
    imports. Returns whether they were installed (False: vLLM is there and is used)."""
    if not force:
        try:
            import vllm  # noqa: F401

            return False
        except ImportError:
            pass

    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        pass

    class SupportsHMA:
        pass

    class KVConnectorHandshakeMetadata:
        pass

    class KVConnectorBase_V1:
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            self._vllm_config, self._role, self._kv_cache_config = vllm_config, role, kv_cache_config

    @dataclass
    class KVConnectorStats:
        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:
        def __init__(self, *args: Any) -> None:
            pass

    def extract_layer_index(name: str) -> int:
        ints = [int(p) for p in name.split(".") if p.isdigit()]
        assert len(ints) == 1, f"layer name {name} should contain one integer"
        return ints[0]

    for pkg in ("vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
                "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.model_executor", "vllm.model_executor.models"):  # fmt: skip
        module(pkg, __path__=[])
    v1 = "vllm.distributed.kv_transfer.kv_connector.v1"
    module(f"{v1}.base", KVConnectorBase_V1=KVConnectorBase_V1, KVConnectorMetadata=KVConnectorMetadata,
           KVConnectorRole=KVConnectorRole, SupportsHMA=SupportsHMA,
           KVConnectorHandshakeMetadata=KVConnectorHandshakeMetadata)  # fmt: skip
    module(f"{v1}.metrics", KVConnectorStats=KVConnectorStats, KVConnectorPromMetrics=KVConnectorPromMetrics)
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.distributed.parallel_state", get_tensor_model_parallel_rank=lambda: 0,
           get_pp_group=lambda: types.SimpleNamespace(rank_in_group=0))  # fmt: skip
    module("vllm.model_executor.models.utils", extract_layer_index=extract_layer_index)
    return True


def single_rank() -> None:
    """vLLM's parallel state for one rank of one (with vLLM installed: no distributed init here)."""
    from vllm.distributed import parallel_state

    parallel_state.get_tensor_model_parallel_rank = lambda: 0
    parallel_state.get_pp_group = lambda: types.SimpleNamespace(rank_in_group=0)


def copy_blocks(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], src_ids: list[int],
                dst_ids: list[int], direction: str) -> None:  # fmt: skip
    """vLLM's ``copy_kv_blocks`` as its CUDA platform does it: per tensor, blocks on dimension 0."""
    if not src_ids or len(src_ids) != len(dst_ids):
        return
    for name, s in src.items():
        d = dst[name]
        si = torch.tensor(src_ids, dtype=torch.int64, device=s.device)
        di = torch.tensor(dst_ids, dtype=torch.int64, device=d.device)
        d[di] = s[si].to(d.device)


# ---- layouts


@dataclass
class Geometry:
    layers: int
    heads: int
    head_dim: int
    block: int  # tokens of a block of the tensors (vLLM's block, or a kernel block of one)
    blocks: int  # vLLM's blocks
    lengths: list[int]  # the requests' prompt lengths, tokens


FAST = Geometry(layers=3, heads=2, head_dim=16, block=16, blocks=24, lengths=[1, 15, 16, 53, 100])
FULL = Geometry(layers=4, heads=8, head_dim=128, block=16, blocks=256, lengths=[1, 15, 16, 300, 1000, 2049])
MLA_WIDTH = 576  # kv_lora_rank 512 + 64 rope dims (DeepSeek)


@dataclass
class Layout:
    name: str
    backend: str
    # (geometry, device) -> per-layer tensors in layer order, each with its block axis
    make: Callable[[Geometry, str], list[torch.Tensor]]
    block_axis: int = 0
    mla: bool = False
    ratio: int = 1  # kernel blocks per vLLM block (P's, and D's unless d_ratio says otherwise)
    d_ratio: int | None = None  # D's kernel blocks per vLLM block where they differ from P's
    host_only: bool = False
    dtype: torch.dtype = torch.float16


def _permuted(shape: tuple[int, ...], logical_from_physical: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Allocated in ``shape`` (memory order), viewed permuted to the backend's logical shape."""
    return torch.empty(shape, dtype=dtype, device=device).permute(*logical_from_physical)


def _pages(g: Geometry, device: str, nhd: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """vLLM 0.3x: one raw allocation, each layer's pages a region of it (layer-compact ``LB..``),
    viewed as ``[blocks, heads, N, K‖V]``; LBNHC keeps tokens outer to heads in memory."""
    per = g.blocks * g.heads * g.block * 2 * g.head_dim
    raw = torch.empty(g.layers * per, dtype=dtype, device=device)
    out = []
    for i in range(g.layers):
        flat = raw[i * per : (i + 1) * per]
        if nhd:
            out.append(flat.view(g.blocks, g.block, g.heads, 2 * g.head_dim).permute(0, 2, 1, 3))
        else:
            out.append(flat.view(g.blocks, g.heads, g.block, 2 * g.head_dim))
    return out


def _layouts() -> list[Layout]:
    f16 = torch.float16

    def each(make: Callable[[Geometry, str], torch.Tensor]) -> Callable[[Geometry, str], list[torch.Tensor]]:
        return lambda g, dev: [make(g, dev) for _ in range(g.layers)]

    return [
        Layout("flash_attn_nhd", "FLASH_ATTN", each(lambda g, d: torch.empty((2, g.blocks, g.block, g.heads, g.head_dim), dtype=f16, device=d)), block_axis=1),
        Layout("flash_attn_hnd", "FLASH_ATTN", each(lambda g, d: _permuted((2, g.blocks, g.heads, g.block, g.head_dim), (0, 1, 3, 2, 4), f16, d)), block_axis=1),
        Layout("flashinfer_nhd", "FLASHINFER", each(lambda g, d: torch.empty((g.blocks, 2, g.block, g.heads, g.head_dim), dtype=f16, device=d))),
        Layout("flashinfer_hnd", "FLASHINFER", each(lambda g, d: _permuted((g.blocks, 2, g.heads, g.block, g.head_dim), (0, 1, 3, 2, 4), f16, d))),
        Layout("triton", "TRITON_ATTN", each(lambda g, d: torch.empty((g.blocks, 2, g.block, g.heads, g.head_dim), dtype=f16, device=d))),
        Layout("pages_lbhnc", "FLASH_ATTN", lambda g, d: _pages(g, d, False, f16)),
        Layout("pages_lbnhc", "FLASH_ATTN", lambda g, d: _pages(g, d, True, f16)),
        Layout("mla_latent", "FLASHMLA", each(lambda g, d: torch.empty((g.blocks, g.block, MLA_WIDTH), dtype=torch.bfloat16, device=d)),
               mla=True, dtype=torch.bfloat16),  # fmt: skip
        # vLLM blocks of 4 kernel blocks (64 tokens of 16): the tensor has 4× vLLM's blocks.
        Layout("kernel_blocks", "FLASH_ATTN", each(lambda g, d: torch.empty((2, 4 * g.blocks, g.block, g.heads, g.head_dim), dtype=f16, device=d)),
               block_axis=1, ratio=4),  # fmt: skip
        # The same kernel blocks, P's vLLM blocks of 4 of them and D's of 2 (its cache: 2× the blocks).
        Layout("kernel_blocks_mixed", "FLASH_ATTN", each(lambda g, d: torch.empty((2, 4 * g.blocks, g.block, g.heads, g.head_dim), dtype=f16, device=d)),
               block_axis=1, ratio=4, d_ratio=2),  # fmt: skip
        Layout("cpu_attn", "CPU_ATTN", each(lambda g, d: torch.empty((g.blocks, g.heads, g.block, 2 * g.head_dim), dtype=f16, device="cpu")),
               host_only=True),  # fmt: skip
    ]  # fmt: skip


LAYOUTS = {lay.name: lay for lay in _layouts()}


def ratio_of(lay: Layout, role: str) -> int:
    """Kernel blocks per vLLM block on ``role``'s side."""
    return lay.d_ratio if role == "d" and lay.d_ratio is not None else lay.ratio


def fill(tensors: list[torch.Tensor], seed: int) -> None:
    """Random bits from ``seed``, generated on the host (the same on every device)."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.view(INT).copy_(torch.randint(-(2**15), 2**15, tuple(t.shape), generator=g, dtype=INT).to(t.device))


# ---- the case both processes build alike


@dataclass
class Case:
    index: int
    layout: str
    buffer: str  # kv_buffer_device
    mode: str
    device: str  # where the cache is
    geometry: Geometry

    @property
    def layerwise(self) -> bool:
        """Mode "layerwise": push, each layer handed over by ``save_kv_layer`` as the forward pass
        writes it (on CUDA, after GPU work that delays the write: the feeder must wait for it)."""
        return self.mode == "layerwise"

    @property
    def name(self) -> str:
        return f"{self.layout}/{self.buffer}/{self.mode}"


def requests(case: Case) -> list[dict[str, Any]]:
    """The requests: lengths from the geometry, fragmented block ids (a shuffled pool, different on P
    and D), kernel block pairs worked out here (never with the connector's expand_block_ids)."""
    g, lay = case.geometry, LAYOUTS[case.layout]
    gen = torch.Generator().manual_seed(SEED + case.index)
    p_pool = torch.randperm(g.blocks, generator=gen).tolist()
    d_pool = torch.randperm(g.blocks, generator=gen).tolist()
    kernel = g.block  # tokens of the tensor's blocks; vLLM's block is `ratio` of them
    p_r, d_r = ratio_of(lay, "p"), ratio_of(lay, "d")
    out = []
    for i, n in enumerate(g.lengths):
        p_need, d_need = -(-n // (kernel * p_r)), -(-n // (kernel * d_r))
        p_ids, d_ids = p_pool[:p_need], d_pool[:d_need]
        p_pool, d_pool = p_pool[p_need:], d_pool[d_need:]
        kernel_blocks = -(-n // kernel)
        p_k = [b * p_r + j for b in p_ids for j in range(p_r)][:kernel_blocks]
        d_k = [b * d_r + j for b in d_ids for j in range(d_r)][:kernel_blocks]
        out.append({
            "req": f"req-{case.index}-{i}", "tid": "%016x%016x" % (case.index + 1, i + 1), "tokens": n,
            "p": p_ids, "d": d_ids, "pairs": list(zip(p_k, d_k)),
        })  # fmt: skip
    assert p_pool and d_pool, "the pool must outlast the requests: blocks no request names stay as they were"
    return out


def build(case: Case, role: str) -> dict[str, torch.Tensor]:
    lay = LAYOUTS[case.layout]
    tensors = lay.make(case.geometry, case.device)
    fill(tensors, SEED * 7 + case.index * 2 + (role == "d"))
    return {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(tensors)}


def vllm_config(case: Case, engine_id: str, role: str) -> tuple[Any, Any]:
    g, lay = case.geometry, LAYOUTS[case.layout]
    ratio = ratio_of(lay, role)
    ns = types.SimpleNamespace
    extra = {"mode": "push" if case.layerwise else case.mode, "side_channel_port": 0,
             "side_channel_listen": "127.0.0.1", "insecure": True}  # fmt: skip
    if case.layerwise:
        extra["layerwise"] = "on"
    vcfg = ns(
        kv_transfer_config=ns(engine_id=engine_id, kv_connector_extra_config=extra, kv_buffer_device=case.buffer),
        model_config=ns(
            get_total_num_kv_heads=lambda: 1 if lay.mla else g.heads,
            get_head_size=lambda: MLA_WIDTH if lay.mla else g.head_dim,
            hf_config=ns(num_hidden_layers=g.layers),
            use_mla=lay.mla,
        ),
        parallel_config=ns(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=ns(block_size=g.block * ratio),
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(g.layers)]
    # vLLM's blocks: the tensors hold ``g.blocks × lay.ratio`` kernel blocks.
    kcc = ns(kv_cache_groups=[ns(layer_names=names, kv_cache_spec=FullAttentionSpec())],
             num_blocks=g.blocks * lay.ratio // ratio)  # fmt: skip
    return vcfg, kcc


# ---- one process: P or D


class Side:
    """One side of one case: its cache, its connector worker, what it saw."""

    def __init__(self, case: Case, role: str, kvv: Any, forced_staging: bool, corrupt: bool = False):
        import kvpush

        self.case, self.role, self.kvv, self.corrupt = case, role, kvv, corrupt
        self.engine_id = f"{'prefill' if role == 'p' else 'decode'}-{case.index}"
        self.caches = build(case, role)
        self.initial = {n: t.clone() for n, t in self.caches.items()}
        self.copies: list[tuple[str, list[int]]] = []
        self.cache_untouched_at_h2d: bool | None = None
        self.configs: list[dict[str, Any]] = []
        self.t0: float | None = None
        real = kvpush.Worker

        def record(config: dict[str, Any]) -> Any:
            self.configs.append(dict(config))
            return real(config)

        kvpush.Worker = record  # what register_kv_caches hands the engine
        try:
            vcfg, kcc = vllm_config(case, self.engine_id, role)
            kvv._backend_name = lambda _cfg: LAYOUTS[case.layout].backend
            if forced_staging:
                # Host tensors stand in for the GPU's: the same host-mirror path, with device "cpu".
                kvv._stages_through_host = lambda buffer, _device: buffer == "cpu"
            self.worker = kvv._Worker(vcfg, kcc, kvv.KVPushConfig.from_vllm(vcfg))
            self.worker.register_kv_caches(self.caches)
            self.worker.set_host_xfer_buffer_ops(self._copy)
        finally:
            kvpush.Worker = real
        self.port = int(self.worker.native.side_channel_port)
        self.save_s = 0.0
        self.gpu_sleep_s = 0.0
        if case.layerwise and role == "p":
            # The forward pass has not written the KV yet: the cache holds other bytes until each
            # layer's write (``run``), which the check then expects (``initial``).
            fill(list(self.caches.values()), SEED * 11 + case.index)

    def _copy(self, src: dict, dst: dict, src_ids: list[int], dst_ids: list[int], direction: str) -> None:
        if direction == "h2d" and self.cache_untouched_at_h2d is None:
            self._sync()
            self.cache_untouched_at_h2d = all(
                torch.equal(self.caches[n].view(INT), self.initial[n].view(INT)) for n in self.caches
            )
        self.copies.append((direction, list(src_ids)))
        copy_blocks(src, dst, src_ids, dst_ids, direction)

    def _sync(self) -> None:
        if self.case.device.startswith("cuda"):
            torch.cuda.synchronize()

    def registered(self) -> str:
        """What the engine registered: the cache ("cache"), a host mirror ("mirror") or neither."""
        config = self.configs[-1]
        spans = {}
        for t in self.caches.values():
            s = t.untyped_storage()
            spans[s.data_ptr()] = s.nbytes()
        inside = [any(a <= b < a + n for a, n in spans.items()) for b in config["region_bases"]]
        if all(inside):
            return "cache"
        mirror = self.worker.host_regions
        if mirror is None or any(inside):
            return "neither"
        hosts = [(r.data_ptr(), r.numel()) for r in mirror.values()]
        return "mirror" if all(any(a == b for a, _ in hosts) for b in config["region_bases"]) else "neither"

    def start(self, reqs: list[dict[str, Any]], p_port: int) -> None:
        """The step's metadata to ``start_load_kv``: P's finished requests, D's registrations or reads."""
        kvv, case = self.kvv, self.case
        meta = kvv.KVPushMetadata()
        for r in reqs:
            if self.role == "p" and case.layerwise:
                meta.prefilled.append(kvv.Finished(r["req"], r["tid"], 1, [r["p"]], r["tokens"], None))
            elif self.role == "p":
                meta.finished.append(kvv.Finished(r["req"], r["tid"], 1, [r["p"]], r["tokens"], None))
            else:
                pull = case.mode == "pull"
                meta.receives.append(kvv.Receive(
                    r["req"], r["tid"], 1, f"prefill-{case.index}", "127.0.0.1", p_port, 1, [r["d"]], r["tokens"],
                    [r["p"]] if pull else None,
                    # P's vLLM block size, as P's scheduler half sends it (remote_block_size).
                    case.geometry.block * LAYOUTS[case.layout].ratio if pull else None,
                ))  # fmt: skip
        self.t0 = time.perf_counter()
        self.worker.start_load_kv(meta)
        if self.role == "p" and case.layerwise:
            self._forward(meta)

    # GPU time each layer's write waits behind (``torch.cuda._sleep`` cycles; ~10 ms at ~2 GHz)
    LAYER_SLEEP_CYCLES = 20_000_000

    def _forward(self, meta: Any) -> None:
        """The forward pass as vLLM runs it with a layer-wise connector: per layer, the layer's KV is
        written on the current stream (on CUDA behind a GPU sleep, so it lands well after the host
        moved on), then ``save_kv_layer``; ``wait_for_save`` after the last layer. ``save_s`` is the
        host time spent in the connector's hooks: on CUDA it must not include the GPU's sleeps."""
        cuda = self.case.device.startswith("cuda")
        t0 = time.perf_counter()
        for name, t in self.caches.items():
            if cuda:
                torch.cuda._sleep(self.LAYER_SLEEP_CYCLES)
            t.copy_(self.initial[name])
            s = time.perf_counter()
            self.worker.save_kv_layer(name, meta)
            self.save_s += time.perf_counter() - s
        s = time.perf_counter()
        self.worker.wait_for_save(meta)
        self.save_s += time.perf_counter() - s
        if cuda:
            host_s = time.perf_counter() - t0
            torch.cuda.synchronize()
            self.gpu_sleep_s = time.perf_counter() - t0 - host_s

    def run(self, reqs: list[dict[str, Any]], p_port: int, limit_s: float) -> dict[str, Any]:
        """Starts (unless ``start`` did), then polls ``get_finished`` until every request is reported."""
        if self.t0 is None:
            self.start(reqs, p_port)
        t0, want = self.t0, {r["req"] for r in reqs}
        done: set[str] = set()
        deadline = time.monotonic() + limit_s
        while done != want and time.monotonic() < deadline:
            sending, recving = self.worker.get_finished()
            done |= sending if self.role == "p" else recving
            time.sleep(0.0005)
        self._sync()
        seconds = time.perf_counter() - t0
        if self.corrupt and self.role == "d":
            # The control: one element of D's cache changed behind the transfer's back.
            first = next(iter(self.caches.values())).view(INT)
            first[(0,) * first.dim()] ^= 1
        errors = sorted(self.worker.get_block_ids_with_load_errors())
        out: dict[str, Any] = {"seconds": seconds, "reported": len(done & want), "load_errors": errors,
                               "registered": self.registered(), "engine_device": self.configs[-1]["device"],
                               "posts": int(self.worker.native.stats()["counters"]["posts"]),
                               "save_s": self.save_s, "gpu_sleep_s": self.gpu_sleep_s}  # fmt: skip
        out.update(self.check(reqs))
        return out

    def check(self, reqs: list[dict[str, Any]]) -> dict[str, Any]:
        """Every byte: D's target blocks hold P's (regenerated from P's seed), all else is unchanged."""
        lay = LAYOUTS[self.case.layout]
        expected = {n: t.clone() for n, t in self.initial.items()}
        moved = 0
        copies_ok = True
        if self.role == "d":
            p_side = build(self.case, "p")
            for n in expected:
                e, src = expected[n], p_side[n]
                for r in reqs:
                    for p, d in r["pairs"]:
                        e.select(lay.block_axis, d).copy_(src.select(lay.block_axis, p))
                        moved += e.select(lay.block_axis, d).numel() * e.element_size()
        if self.worker.host_regions is not None:
            ids = sorted({(p if self.role == "p" else d) for r in reqs for p, d in r["pairs"]})
            got = sorted({b for _, bs in self.copies for b in bs})
            copies_ok = got == ids and {d for d, _ in self.copies} == {"d2h" if self.role == "p" else "h2d"}
        wrong = 0
        for n, t in self.caches.items():
            a, b = t.view(INT), expected[n].view(INT)
            wrong += int((a != b).sum().item()) * 2
        return {"bytes": moved, "wrong_bytes": wrong, "copies_ok": copies_ok,
                "copies": [(d, len(b)) for d, b in self.copies], "cache_untouched_at_h2d": self.cache_untouched_at_h2d}  # fmt: skip

    def close(self) -> None:
        self.worker.native = None
        self.worker = None
        self.caches = self.initial = {}


class _DoneEvent:
    """The ``--control-no-wait`` control's stand-in for a CUDA event: reports done at once."""

    def synchronize(self) -> None:
        pass


def child(role: str, conn: Any, forced_staging: bool, corrupt: bool, stand_ins: bool, no_wait: bool = False) -> None:
    """P or D: serves the parent's commands until ``None``."""
    os.environ.setdefault("KVPUSH_LOG", "error")  # the engine's insecure-mode warning at every start
    stand_ins = install_vllm_stand_ins(force=stand_ins)
    if not stand_ins:
        single_rank()
    import kvpush.vllm as kvv

    if no_wait:
        # The control of the layer-wise CUDA check: a feeder that does not wait for the layer's
        # write hands the engine blocks the GPU has not written yet.
        kvv._Worker._new_event = staticmethod(lambda: _DoneEvent())

    logging.getLogger("kvpush").setLevel(logging.ERROR)
    side: Side | None = None
    conn.send(("ready", stand_ins))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        cmd, args = msg
        try:
            if cmd == "setup":
                side = Side(args["case"], role, kvv, forced_staging, corrupt)
                conn.send(("ok", side.port))
            elif cmd == "start":
                assert side is not None
                side.start(args["reqs"], args["p_port"])
                conn.send(("ok", None))
            elif cmd == "run":
                assert side is not None
                conn.send(("ok", side.run(args["reqs"], args["p_port"], args["limit_s"])))
            elif cmd == "close":
                if side is not None:
                    side.close()
                side = None
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                conn.send(("ok", None))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))


# ---- the parent


def call(conn: Any, cmd: str, limit_s: float, **args: Any) -> Any:
    conn.send((cmd, args))
    if not conn.poll(limit_s):
        raise TimeoutError(f"{cmd}: no answer within {limit_s} s")
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(value)
    return value


def run_case(case: Case, p: Any, d: Any, limit_s: float, forced_staging: bool) -> dict[str, Any]:
    lay = LAYOUTS[case.layout]
    row: dict[str, Any] = {"layout": case.layout, "backend": lay.backend, "buffer": case.buffer, "mode": case.mode,
                           "device": case.device, "ok": False}  # fmt: skip
    t0 = time.perf_counter()
    try:
        p_port = call(p, "setup", limit_s, case=case)
        call(d, "setup", limit_s, case=case)
        reqs = requests(case)
        if case.mode == "pull":
            # As in vLLM: P's request has finished (its blocks are the engine's) before D learns of it.
            call(p, "start", limit_s, reqs=reqs, p_port=p_port)
        if case.layerwise:
            # As a push router does: D registers at admission, while P's forward pass is still ahead,
            # so each layer can leave as it is written.
            call(d, "start", limit_s, reqs=reqs, p_port=p_port)
            time.sleep(0.5)
        d.send(("run", {"reqs": reqs, "p_port": p_port, "limit_s": limit_s}))
        p.send(("run", {"reqs": reqs, "p_port": p_port, "limit_s": limit_s}))
        results = {}
        for role, conn in (("d", d), ("p", p)):
            if not conn.poll(limit_s + 30):
                raise TimeoutError(f"{role}: no result within {limit_s + 30} s")
            status, value = conn.recv()
            if status != "ok":
                raise RuntimeError(f"{role}: {value}")
            results[role] = value
        pr, dr = results["p"], results["d"]
        staged = case.buffer == "cpu" and (case.device.startswith("cuda") or forced_staging)
        want_registered = "mirror" if staged else "cache"
        row.update(
            requests=len(reqs), tokens=sum(r["tokens"] for r in reqs), blocks=sum(len(r["pairs"]) for r in reqs),
            bytes=dr["bytes"], seconds=dr["seconds"], p_seconds=pr["seconds"],
            wrong_bytes_d=dr["wrong_bytes"], wrong_bytes_p=pr["wrong_bytes"],
            reported_p=pr["reported"], reported_d=dr["reported"], load_errors=dr["load_errors"],
            registered_p=pr["registered"], registered_d=dr["registered"], engine_device=dr["engine_device"],
            copies_p=pr["copies"], copies_d=dr["copies"], cache_untouched_at_h2d=dr["cache_untouched_at_h2d"],
            posts_p=pr["posts"], save_s=pr["save_s"], gpu_sleep_s=pr["gpu_sleep_s"],
        )  # fmt: skip
        checks = {
            "every request reported on P and D": pr["reported"] == dr["reported"] == len(reqs),
            "no load errors": not dr["load_errors"],
            "D's cache: P's bytes in the target blocks, its own elsewhere": dr["wrong_bytes"] == 0,
            "P's cache unchanged": pr["wrong_bytes"] == 0,
            f"the engine registered the {want_registered}": pr["registered"] == dr["registered"] == want_registered,
        }
        if case.layerwise:
            # One post per request would be the whole request at once.
            checks["P posted layers separately"] = pr["posts"] > len(reqs)
            if case.device.startswith("cuda"):
                # The hooks only record events: the host never waited for the GPU's layer writes.
                checks["save_kv_layer never waited for the GPU"] = pr["save_s"] < 0.25 * pr["gpu_sleep_s"]
        if staged:
            checks["copies named exactly the request blocks"] = pr["copies_ok"] and dr["copies_ok"]
            checks["D's cache untouched until the copy to it"] = dr["cache_untouched_at_h2d"] is True
        failed = [k for k, v in checks.items() if not v]
        row["failed_checks"] = failed
        row["ok"] = not failed and dr["bytes"] > 0
    except Exception as e:
        row["error"] = str(e)
    finally:
        row["case_seconds"] = time.perf_counter() - t0
        for conn in (d, p):  # D first: P leaving first would be a lost peer to D
            try:
                call(conn, "close", limit_s)
            except Exception as e:
                row.setdefault("error", f"close: {e}")
                row["ok"] = False
    return row


def cases(args: argparse.Namespace) -> list[Case]:
    g = FAST if args.fast else FULL
    out = []
    for name in args.layouts.split(","):
        lay = LAYOUTS[name]
        device = "cpu" if lay.host_only else args.device
        buffers = ["cpu"] if device == "cpu" and not args.forced_staging else args.buffers.split(",")
        for buffer in buffers:
            if buffer == "cuda" and device == "cpu":
                continue
            for mode in args.modes.split(","):
                if mode == "layerwise" and buffer == "cpu" and (device != "cpu" or args.forced_staging):
                    continue  # a host mirror is filled after prefill: refused with layer-wise (docs/vllm.md)
                out.append(Case(len(out), name, buffer, mode, device, g))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'layout':<16} {'buffer':<6} {'mode':<9} {'device':<7} {'reqs':>4} {'blocks':>6} {'bytes':>12} "
             f"{'verified':<9} {'seconds':>8}  notes"]  # fmt: skip
    for r in rows:
        if "refused" in r:
            verified, note = ("refused" if r["ok"] else "FAILED"), r["refused"].split("; ")[0][:110]
        else:
            verified = "yes" if r["ok"] else "NO"
            note = "; ".join(r.get("failed_checks") or []) or r.get("error", "")[:200]
            if r.get("registered_d") == "mirror" and r["ok"]:
                ps, ds = r["copies_p"], r["copies_d"]
                note = (f"host mirror registered; P: {len(ps)} d2h copies of {sum(n for _, n in ps)} blocks, "
                        f"D: {len(ds)} h2d copies of {sum(n for _, n in ds)}")  # fmt: skip
        lines.append(
            f"{r['layout']:<16} {r['buffer']:<6} {r['mode']:<9} {r['device']:<7} {r.get('requests', ''):>4} "
            f"{r.get('blocks', ''):>6} {r.get('bytes', ''):>12} {verified:<9} {r.get('seconds', 0):>8.3f}  {note}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of: " + ", ".join(LAYOUTS))
    ap.add_argument("--buffers", default="cuda,cpu", help="kv_buffer_device values (cuda: direct; cpu: host mirror)")
    ap.add_argument("--modes", default="push,pull",
                    help="of push, pull, layerwise (push with layerwise on, driven through save_kv_layer)")  # fmt: skip
    ap.add_argument("--fast", action="store_true", help="small caches and few requests (CI)")
    ap.add_argument("--forced-staging", action="store_true",
                    help="on host tensors, take the host-mirror path for kv_buffer_device=cpu (CI: no GPU)")  # fmt: skip
    ap.add_argument("--control-no-wait", action="store_true",
                    help="the layer-wise CUDA check's control: the feeder does not wait for the layer's event "
                         "(every layerwise row on CUDA must fail)")  # fmt: skip
    ap.add_argument("--control-corrupt", action="store_true",
                    help="the check's control: D changes one element of its cache after the transfer (every row must fail)")  # fmt: skip
    ap.add_argument("--limit-s", type=float, default=60.0, help="per step of a case")
    ap.add_argument("--vllm", choices=("auto", "stand-ins"), default="auto",
                    help="auto: vLLM's modules where installed, else stand-ins; stand-ins: always (the GPU machine's path)")  # fmt: skip
    ap.add_argument("--start-s", type=float, default=600.0, help="for P and D to import torch and kvpush")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no case after this many seconds (0: no limit)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("connector_layouts: --device cuda but torch sees no GPU", file=sys.stderr)
            return 2
        if args.device == "cuda":
            args.device = "cuda:0"
    unknown = set(args.layouts.split(",")) - set(LAYOUTS)
    if unknown:
        ap.error(f"unknown layouts {sorted(unknown)}")
    ctx = mp.get_context("spawn")
    sides = {}
    procs = []
    for role in ("p", "d"):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=child, args=(role, theirs, args.forced_staging, args.control_corrupt, args.vllm == "stand-ins",
                                                 args.control_no_wait),
                           name=f"connector-layouts-{role}")  # fmt: skip
        proc.start()
        procs.append(proc)
        sides[role] = mine
    stand_ins = None
    for conn in sides.values():
        if not conn.poll(args.start_s):
            print(f"connector_layouts: a child did not start within {args.start_s} s", file=sys.stderr)
            for proc in procs:
                proc.kill()
            return 2
        stand_ins = conn.recv()[1]
    vllm = "its own modules"
    if stand_ins:
        vllm = "minimal stand-ins for its connector base, metrics, logger, parallel_state and models.utils modules"
    gpu = f" ({torch.cuda.get_device_name(args.device)})" if args.device.startswith("cuda") else ""
    print(f"connector_layouts: P and D are two processes; vLLM: {vllm}; torch {torch.__version__}; "
          f"device {args.device}{gpu}", flush=True)  # fmt: skip
    rows = []
    t0 = time.perf_counter()
    skipped = []
    for case in cases(args):
        if args.budget_s and time.perf_counter() - t0 > args.budget_s:
            skipped.append(case.name)
            continue
        row = run_case(case, sides["p"], sides["d"], args.limit_s, args.forced_staging)
        rows.append(row)
        print(table([row]).splitlines()[1], flush=True)
    for conn in sides.values():
        conn.send(None)
    for proc in procs:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    print()
    print(table(rows))
    passed = sum(r["ok"] for r in rows)
    total_bytes = sum(r.get("bytes", 0) for r in rows if r["ok"])
    summary = (f"connector_layouts: {passed}/{len(rows)} passed on {args.device}, {total_bytes} bytes verified, "
               f"{time.perf_counter() - t0:.1f} s" + ("" if passed == len(rows) else "; FAILED: " + ", ".join(
                   f"{r['layout']}/{r['buffer']}/{r['mode']}" for r in rows if not r["ok"]))
               + (f"; {len(skipped)} not run (--budget-s spent): {', '.join(skipped)}" if skipped else ""))  # fmt: skip
    print(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "vllm_stand_ins": stand_ins, "torch": torch.__version__,
                       "fast": args.fast, "rows": rows, "skipped": skipped, "summary": summary}, f, indent=1)  # fmt: skip
    return 0 if rows and passed == len(rows) and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
