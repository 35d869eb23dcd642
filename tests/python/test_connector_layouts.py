"""``describe_kv_caches`` for every layout vLLM's attention backends use, without servers.

Each case builds torch CPU tensors shaped and strided exactly as the backend lays out its KV cache — the
pre-0.3 backends' ``get_kv_cache_shape`` with their stride orders (a permuted view of the physical
allocation, as vLLM makes it), and vLLM 0.3x's pages made by vLLM's own ``create_kv_cache_views`` — and
asserts the placement, order, block geometry and every region (base and length) the engine receives.
Then the description goes through the native layout (``kvpush.check_layout``: the engine's own
validation), which must agree on the bytes a block holds and each region's length; and for the layouts
the connector cannot use, the start-up error must name the backend and the shape.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
lay = pytest.importorskip("kvpush._layouts", reason="the kvpush package (maturin develop)")
kvpush = pytest.importorskip("kvpush", reason="the kvpush package (maturin develop)")
kvi = pytest.importorskip("vllm.v1.kv_cache_interface", reason="vLLM")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

LAYERS = 3
HEADS = 4  # this rank's KV heads (the model's, TP 1)
D = 8  # head size
N = 16  # block size in tokens
BLOCKS = 6
DT = torch.float16
ES = 2
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]

class FullAttentionSpec:
    """Stands for vLLM's spec of a full-attention layer (the connector goes by the spec's type name)."""

    sliding_window = None



def layer_index(name: str) -> int:
    return int(name.split(".")[2])


def describe(caches: dict[str, Any], *, backend: str | None, block_size: int = N, mla: bool = False, **kw: Any):
    return lay.describe_kv_caches(
        caches,
        [(list(caches), 0)],
        total_layers=LAYERS,
        total_kv_heads=HEADS,
        head_dim=kw.pop("head_dim", D),
        block_size=block_size,
        layer_index=layer_index,
        backend=backend,
        mla=mla,
        num_blocks=kw.pop("num_blocks", BLOCKS),
        local_kv_heads=kw.pop("local_kv_heads", HEADS),
    )


def per_layer(make) -> dict[str, Any]:
    return {n: make() for n in NAMES}


def physical(shape: tuple[int, ...], logical_from_physical: tuple[int, ...]) -> Any:
    """A tensor allocated in ``shape`` (memory order) and viewed permuted to vLLM's logical shape."""
    return torch.zeros(shape, dtype=DT).permute(*logical_from_physical)


def check_native(desc: dict[str, Any]) -> dict[str, Any]:
    """The engine's own reading of the description: validated, same block bytes and region lengths."""
    cfg = {k: v for k, v in desc.items() if not k.startswith("_")}
    got = kvpush.check_layout(cfg)
    assert got["placement"] == desc["placement"] and got["order"] == desc["order"]
    assert got["block_stride"] == desc["block_stride"] and got["block_tokens"] == desc["block_tokens"]
    assert got["regions"] == len(desc["region_bases"])
    assert all(got["region_len"] == n for n in desc["region_lens"])
    return got


def regions_of(views: list[Any]) -> list[tuple[int, int]]:
    return [(v.data_ptr(), v.shape[0] * v.stride(0) * ES) for v in views]


# ---- vLLM before 0.3: get_kv_cache_shape and stride order


@pytest.mark.parametrize("hnd", [False, True])
def test_flash_attention_separate_k_and_v(hnd: bool) -> None:
    # FlashAttention: (2, blocks, N, H, D); HND allocates (2, blocks, H, N, D) and permutes back.
    caches = per_layer(lambda: physical((2, BLOCKS, HEADS, N, D), (0, 1, 3, 2, 4)) if hnd else torch.zeros((2, BLOCKS, N, HEADS, D), dtype=DT))
    d = describe(caches, backend="FLASH_ATTN")
    assert (d["placement"], d["order"], d["kv_kind"]) == ("separate", "hnd" if hnd else "nhd", "key_value")
    assert (d["block_tokens"], d["num_blocks"], d["_blocks_per_block"], d["_local_heads"]) == (N, BLOCKS, 1, HEADS)
    assert d["block_stride"] == N * HEADS * D * ES
    want = [r for n in NAMES for r in regions_of([caches[n][0], caches[n][1]])]
    assert list(zip(d["region_bases"], d["region_lens"])) == want
    got = check_native(d)
    assert got["part_bytes"] == N * HEADS * D * ES and got["regions"] == 2 * LAYERS


@pytest.mark.parametrize(("backend", "hnd"), [("FLASHINFER", False), ("FLASHINFER", True), ("TRITON_ATTN", False)])
def test_flashinfer_and_triton_joint_blocks(backend: str, hnd: bool) -> None:
    # FlashInfer and Triton: (blocks, 2, N, H, D); each block holds its K part then its V part.
    caches = per_layer(lambda: physical((BLOCKS, 2, HEADS, N, D), (0, 1, 3, 2, 4)) if hnd else torch.zeros((BLOCKS, 2, N, HEADS, D), dtype=DT))
    d = describe(caches, backend=backend)
    assert (d["placement"], d["order"]) == ("joint", "hnd" if hnd else "nhd")
    assert (d["block_tokens"], d["num_blocks"], d["block_stride"]) == (N, BLOCKS, 2 * N * HEADS * D * ES)
    assert list(zip(d["region_bases"], d["region_lens"])) == regions_of([caches[n] for n in NAMES])
    assert check_native(d)["part_bytes"] == N * HEADS * D * ES


def test_cpu_backend_head_joint() -> None:
    # vLLM CPU: (blocks, H, N, 2·D); each head holds its K tokens then its V tokens.
    caches = per_layer(lambda: torch.zeros((BLOCKS, HEADS, N, 2 * D), dtype=DT))
    d = describe(caches, backend="CPU_ATTN")
    assert (d["placement"], d["order"], d["block_stride"]) == ("head_joint", "hnd", HEADS * N * 2 * D * ES)
    assert list(zip(d["region_bases"], d["region_lens"])) == regions_of([caches[n] for n in NAMES])
    check_native(d)
    # Without a backend name, host tensors are vLLM CPU's.
    assert describe(caches, backend=None)["placement"] == "head_joint"


def test_mla_latent_one_region_per_layer() -> None:
    # MLA: (blocks, N, L), one latent vector of L = kv_lora_rank + rope dims per token.
    latent = 576
    caches = per_layer(lambda: torch.zeros((BLOCKS, N, latent), dtype=DT))
    d = describe(caches, backend="FLASHMLA", mla=True, head_dim=latent, local_kv_heads=1)
    assert (d["placement"], d["kv_kind"], d["kv_heads"], d["head_dim"]) == ("single", "latent", 1, latent)
    assert d["block_stride"] == N * latent * ES
    assert list(zip(d["region_bases"], d["region_lens"])) == regions_of([caches[n] for n in NAMES])
    assert check_native(d)["regions"] == LAYERS


def test_kernel_blocks_smaller_than_vllm_blocks() -> None:
    # A 64-token vLLM block in 16-token kernel blocks: FlashAttention's cache has 4× the blocks.
    caches = per_layer(lambda: torch.zeros((2, BLOCKS * 4, N, HEADS, D), dtype=DT))
    d = describe(caches, backend="FLASH_ATTN", block_size=4 * N)
    assert (d["block_tokens"], d["num_blocks"], d["_blocks_per_block"]) == (N, 4 * BLOCKS, 4)
    check_native(d)
    assert lay.expand_block_ids([[2, 0], [5]], 4) == [[8, 9, 10, 11, 0, 1, 2, 3], [20, 21, 22, 23]]
    assert lay.expand_block_ids([[2, 0]], 1) == [[2, 0]]
    # 70 tokens in 64-token vLLM blocks of 16-token kernel blocks: 5 kernel blocks hold them; the last
    # vLLM block's 3 trailing kernel blocks are dropped (the engine takes at most ceil(70 / 16) = 5).
    assert lay.expand_block_ids([[2, 0], [5]], 4, 70, 16) == [[8, 9, 10, 11, 0], [20]]
    assert lay.expand_block_ids([[2, 0]], 4, 128, 16) == [[8, 9, 10, 11, 0, 1, 2, 3]]


# ---- vLLM 0.3x: [blocks, H, N, K‖V] pages from vLLM's create_kv_cache_views


def pages(layout: Any, *, mla: bool = False, kernel: int | None = None, block_size: int = N) -> dict[str, Any]:
    if mla:
        spec = kvi.MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=DT)
    else:
        spec = kvi.FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=D, dtype=DT)
    page = spec.page_size_bytes
    compact = layout.is_layer_compact
    t = kvi.KVCacheTensor(
        size=page * BLOCKS * LAYERS,
        layers=list(NAMES),
        layer_stride=page * BLOCKS if compact else page,
        block_stride=page if compact else page * LAYERS,
    )
    raw = torch.zeros(t.size, dtype=torch.int8)
    views = kvi.create_kv_cache_views(raw, spec, BLOCKS, layout, t, kernel_block_size=kernel)
    return dict(zip(NAMES, views))


@pytest.mark.parametrize(("layout", "order"), [(KVCacheLayout.LBHNC, "hnd"), (KVCacheLayout.LBNHC, "nhd")])
def test_gpu_pages_of_k_v_cells(layout: Any, order: str) -> None:
    caches = pages(layout)
    d = describe(caches, backend="FLASH_ATTN")
    assert (d["placement"], d["order"], d["block_tokens"], d["num_blocks"]) == ("cell_joint", order, N, BLOCKS)
    assert d["block_stride"] == HEADS * N * 2 * D * ES
    assert list(zip(d["region_bases"], d["region_lens"])) == regions_of([caches[n] for n in NAMES])
    assert check_native(d)["part_bytes"] == N * HEADS * D * ES


def test_cpu_pages_from_vllm_are_head_joint() -> None:
    # vLLM 0.32's CPU backend takes LBHNC pages and reads each head as K tokens then V tokens.
    d = describe(pages(KVCacheLayout.LBHNC), backend="CPU_ATTN")
    assert (d["placement"], d["order"]) == ("head_joint", "hnd")


def test_gpu_pages_with_kernel_blocks() -> None:
    caches = pages(KVCacheLayout.LBHNC, kernel=N, block_size=4 * N)
    d = describe(caches, backend="FLASH_ATTN", block_size=4 * N)
    assert (d["placement"], d["block_tokens"], d["num_blocks"], d["_blocks_per_block"]) == ("cell_joint", N, 4 * BLOCKS, 4)
    assert d["block_stride"] == HEADS * N * 2 * D * ES
    check_native(d)


def test_mla_pages() -> None:
    caches = pages(KVCacheLayout.LBHNC, mla=True)
    d = describe(caches, backend="FLASHMLA", mla=True, head_dim=576, local_kv_heads=1)
    assert (d["placement"], d["kv_kind"], d["head_dim"], d["block_stride"]) == ("single", "latent", 576, N * 576 * ES)
    check_native(d)


# ---- refused at start-up, naming backend and shape


def test_block_outermost_pages_are_refused() -> None:
    # BLHNC: every block holds all layers' pages, so the layers' regions overlap.
    caches = pages(KVCacheLayout.BLHNC)
    with pytest.raises(lay.LayoutUnknown, match=r"FLASH_ATTN.*\(6, 4, 16, 16\).*layers share blocks.*LBHNC"):
        describe(caches, backend="FLASH_ATTN")


@pytest.mark.parametrize(
    ("make", "backend", "shape"),
    [
        (lambda: torch.zeros((BLOCKS, N, HEADS), dtype=DT), "FLASH_ATTN", r"\(6, 16, 4\)"),  # no head dim
        (lambda: torch.zeros((3, BLOCKS, N, HEADS, D), dtype=DT), "FLASH_ATTN", r"\(3, 6, 16, 4, 8\)"),  # 3 parts
        (lambda: torch.zeros((2, BLOCKS, N, HEADS, D), dtype=torch.int32), "FLASH_ATTN", "int32"),
        # Heads outermost (LHBNC): a block is not one run of memory.
        (lambda: physical((HEADS, BLOCKS, N, 2 * D), (1, 0, 2, 3)), "FLASH_ATTN", r"\(6, 4, 16, 16\)"),
        # vLLM CPU with token-major pages: its kernels read head-major ones only.
        (lambda: physical((BLOCKS, N, HEADS, 2 * D), (0, 2, 1, 3)), "CPU_ATTN", r"CPU_ATTN.*\(6, 4, 16, 16\)"),
        # A block of 24 tokens is not 16-token blocks nor a kernel block of them.
        (lambda: torch.zeros((2, BLOCKS, 24, HEADS, D), dtype=DT), "FLASH_ATTN", r"\(2, 6, 24, 4, 8\)"),
    ],
)
def test_unknown_layouts_name_backend_and_shape(make: Any, backend: str, shape: str) -> None:
    with pytest.raises(lay.LayoutUnknown, match=shape) as e:
        describe(per_layer(make), backend=backend)
    assert backend in str(e.value) and "block size 16" in str(e.value)


def test_wrong_head_count_is_not_read_as_another_layout() -> None:
    # 4 heads where this rank should hold 2 (TP 2 of 4 heads): refused, not guessed.
    caches = per_layer(lambda: torch.zeros((2, BLOCKS, N, HEADS, D), dtype=DT))
    with pytest.raises(lay.LayoutUnknown, match="no known layout"):
        describe(caches, backend="FLASH_ATTN", local_kv_heads=2)


# ---- the worker half hands the engine kernel block ids


class _Recorder:
    """Stands in for the native worker: records calls, returns canned outcomes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.outcomes: list[tuple[Any, ...]] = []

    def request_finished(self, *args: Any, consumer_engine_id: str | None = None) -> None:
        self.calls.append(("request_finished", *args, consumer_engine_id))

    def blocks_allocated(self, *args: Any) -> None:
        self.calls.append(("blocks_allocated", *args))

    def start_pull(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("start_pull", *args, kwargs))

    def poll(self) -> list[tuple[Any, ...]]:
        out, self.outcomes = self.outcomes, []
        return out


def test_worker_expands_vllm_block_ids_to_kernel_blocks_and_back() -> None:
    kvv = pytest.importorskip("kvpush.vllm", reason="vLLM")
    import connector_kit as kit

    w = kit.worker(_Recorder(), blocks_per_block=4, kernel_tokens=16)
    p_key, d_key = "1" * 32, "2" * 32
    meta = kvv.KVPushMetadata(
        finished=[kvv.Finished("p-req", p_key, 1, [[2, 0]], 100, "decode-1")],
        receives=[kvv.Receive("d-req", d_key, 1, "prefill-0", "10.0.0.1", 5600, 1, [[5]], 40)],
    )
    w.start_load_kv(meta)
    # Exact counts: 100 tokens are 7 kernel blocks of 16, 40 tokens 3; the rest of the last vLLM block
    # holds none of the request and is not handed over.
    assert w.native.calls == [
        ("request_finished", p_key, 1, [[8, 9, 10, 11, 0, 1, 2]], 100, "decode-1"),
        ("blocks_allocated", d_key, 1, "prefill-0", "10.0.0.1", 5600, 1, [[20, 21, 22]], 40),
    ]
    # A failure names kernel blocks; vLLM is told its own block.
    w.native.outcomes = [("failed", d_key, 1, "read failed", [[21, 22]])]
    assert w.get_finished() == (set(), {"d-req"})
    assert w.get_block_ids_with_load_errors() == {5}


def test_pulling_worker_expands_its_own_ids_and_hands_ps_with_their_block_size() -> None:
    # D: 64-token vLLM blocks of 32-token kernel blocks; P: 128-token vLLM blocks (its kernel blocks
    # only its engine knows). D expands its own ids; P's go to the engine as P named them, with their
    # size, for the engine to expand with the kernel block size P published at the handshake.
    kvv = pytest.importorskip("kvpush.vllm", reason="vLLM")
    import connector_kit as kit

    w = kit.worker(_Recorder(), blocks_per_block=2, kernel_tokens=32)
    new, old = "3" * 32, "4" * 32
    meta = kvv.KVPushMetadata(
        receives=[
            kvv.Receive("d-new", new, 1, "prefill-0", "10.0.0.1", 5600, 1, [[5, 1]], 100, [[7]], 128),
            # A producer that did not say (older params): no size, the engine's default.
            kvv.Receive("d-old", old, 1, "prefill-0", "10.0.0.1", 5600, 1, [[2]], 40, [[9]]),
        ],
    )
    w.start_load_kv(meta)
    assert w.native.calls == [
        ("start_pull", new, 1, "prefill-0", "10.0.0.1", 5600, 1, [[7]], [[10, 11, 2, 3]], 100, {"remote_block_tokens": 128}),
        ("start_pull", old, 1, "prefill-0", "10.0.0.1", 5600, 1, [[9]], [[4, 5]], 40, {"remote_block_tokens": None}),
    ]
    # A failed pull names D's kernel blocks; vLLM is told its own blocks.
    w.native.outcomes = [("failed", new, 1, "read failed", [[11, 2]])]
    assert w.get_finished() == (set(), {"d-new"})
    assert w.get_block_ids_with_load_errors() == {5, 1}


# ---- kv_buffer_device "cpu" on a GPU: the engine moves a host mirror (host tensors stand in for the GPU's)


class _Engine(_Recorder):
    """The native worker as register_kv_caches starts it: keeps its config, logs into ``log``."""

    side_channel_port = 0

    def __init__(self, config: dict[str, Any], log: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.config, self.calls = config, log


def staged_worker(monkeypatch: pytest.MonkeyPatch, log: list[tuple[Any, ...]], engine_id: str) -> tuple[Any, dict[str, Any]]:
    """A worker half on FlashAttention HND caches with kv_buffer_device "cpu", taking the GPU's path."""
    from types import SimpleNamespace as ns

    kvv = pytest.importorskip("kvpush.vllm", reason="vLLM")
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: ns(rank_in_group=0))
    monkeypatch.setattr(kvv, "_backend_name", lambda _cfg: "FLASH_ATTN")
    monkeypatch.setattr(kvv, "_stages_through_host", lambda buffer, _device: buffer == "cpu")
    monkeypatch.setattr(kvpush, "Worker", lambda config: _Engine(config, log))
    vcfg = ns(
        kv_transfer_config=ns(engine_id=engine_id, kv_connector_extra_config={"side_channel_port": 0}, kv_buffer_device="cpu"),
        model_config=ns(get_total_num_kv_heads=lambda: HEADS, get_head_size=lambda: D, use_mla=False,
                        hf_config=ns(num_hidden_layers=LAYERS)),
        parallel_config=ns(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=ns(block_size=N),
    )  # fmt: skip
    kcc = ns(kv_cache_groups=[ns(layer_names=NAMES, kv_cache_spec=FullAttentionSpec())], num_blocks=BLOCKS)
    caches = per_layer(lambda: physical((2, BLOCKS, HEADS, N, D), (0, 1, 3, 2, 4)))
    for i, t in enumerate(caches.values()):
        t.view(torch.int16).copy_(torch.arange(t.numel(), dtype=torch.int16).view(t.shape) * (i + 2) + len(engine_id))
    w = kvv._Worker(vcfg, kcc, kvv.KVPushConfig.from_vllm(vcfg))
    w.register_kv_caches(caches)

    def copy(src: dict, dst: dict, src_ids: list[int], dst_ids: list[int], direction: str) -> None:
        log.append(("copy", direction, list(src_ids), list(dst_ids)))
        for k in src:
            dst[k][torch.tensor(dst_ids)] = src[k][torch.tensor(src_ids)]

    w.set_host_xfer_buffer_ops(copy)
    return w, caches


def test_kv_buffer_device_cpu_moves_a_host_mirror_through_the_copy_op(monkeypatch: pytest.MonkeyPatch) -> None:
    kvv = pytest.importorskip("kvpush.vllm", reason="vLLM")
    p_log: list[tuple[Any, ...]] = []
    d_log: list[tuple[Any, ...]] = []
    p, p_caches = staged_worker(monkeypatch, p_log, "prefill-0")
    d, d_caches = staged_worker(monkeypatch, d_log, "decode-0")
    d_before = {n: t.clone() for n, t in d_caches.items()}
    # The engine registered the mirror: every region outside every cache tensor, one per K and V of
    # each layer, at the cache's own offsets.
    for w, caches in ((p, p_caches), (d, d_caches)):
        cfg = w.native.config
        assert cfg["device"] == "host" and len(cfg["region_bases"]) == 2 * LAYERS
        for n, t in caches.items():
            lo, hi = t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()
            assert not any(lo <= b < hi for b in cfg["region_bases"]), "the engine registered the cache itself"
        assert cfg["region_bases"] == [r.data_ptr() for r in w.host_regions.values()]
    tid = "7" * 32
    # P: the copy to the host comes before the engine hears of the blocks.
    p.start_load_kv(kvv.KVPushMetadata(finished=[kvv.Finished("p-req", tid, 1, [[4, 1]], 20, None)]))
    assert [c[:3] for c in p_log] == [("copy", "d2h", [1, 4]), ("request_finished", tid, 1)]
    for layer, n in enumerate(NAMES):
        for kv in (0, 1):
            host = p.host_regions[str(2 * layer + kv)]
            for b in (1, 4):
                memory_order = p_caches[n][kv, b].permute(1, 0, 2).contiguous()  # HND: [heads, N, D]
                assert torch.equal(host[b], memory_order.view(torch.uint8).reshape(-1)), (n, kv, b)
    # D: the engine writes P's blocks 4, 1 into D's mirror blocks 0, 5 (what NIXL would do).
    d.start_load_kv(kvv.KVPushMetadata(receives=[kvv.Receive("d-req", tid, 1, "prefill-0", "127.0.0.1", 1, 1, [[0, 5]], 20)]))
    assert d_log[-1][0] == "blocks_allocated" and d_log[-1][7] == [[0, 5]]
    for k in p.host_regions:
        d.host_regions[k][0], d.host_regions[k][5] = p.host_regions[k][4], p.host_regions[k][1]
    assert all(torch.equal(d_caches[n].view(torch.int16), d_before[n].view(torch.int16)) for n in NAMES)
    d.native.outcomes = [("received", tid, 1, "", [])]
    assert d.get_finished() == (set(), {"d-req"})
    assert d_log[-1] == ("copy", "h2d", [0, 5], [0, 5])
    for n in NAMES:
        want = d_before[n].clone()
        want[:, 0], want[:, 5] = p_caches[n][:, 4], p_caches[n][:, 1]
        assert torch.equal(d_caches[n].view(torch.int16), want.view(torch.int16)), n
    # A failed copy to the GPU is a failed load: vLLM is told the blocks.
    d.start_load_kv(kvv.KVPushMetadata(receives=[kvv.Receive("d-2", tid, 2, "prefill-0", "127.0.0.1", 1, 1, [[3]], 5)]))
    d.set_host_xfer_buffer_ops(None)
    d.native.outcomes = [("received", tid, 2, "", [])]
    assert d.get_finished() == (set(), {"d-2"}) and d.get_block_ids_with_load_errors() == {3}


# ---- hybrid models: vLLM's hybrid allocator (several KV cache groups sharing tensors)


def hybrid_config(window: int = 32, third: Any = None) -> Any:
    """A KVCacheConfig shaped as vLLM's hybrid allocator makes one for a model whose layers alternate full
    attention (0, 2) and a ``window``-token sliding window (1, 3): two groups with their own block tables,
    and the groups' KVCacheTensors aliasing one allocation from byte 0 (so layer 1 lives in layer 0's
    bytes, layer 3 in layer 2's). ``third``: a spec for a third group of one layer (layer 4)."""
    full = kvi.FullAttentionSpec(block_size=N, num_kv_heads=HEADS, head_size=D, dtype=DT)
    sw = kvi.SlidingWindowSpec(block_size=N, num_kv_heads=HEADS, head_size=D, dtype=DT, sliding_window=window)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    page = full.page_size_bytes
    groups = [kvi.KVCacheGroupSpec([names[0], names[2]], full), kvi.KVCacheGroupSpec([names[1], names[3]], sw)]
    size = page * BLOCKS * 2
    tensors = [
        kvi.KVCacheTensor(size=size, layers=[names[0], names[2]], layer_stride=page * BLOCKS, block_stride=page),
        kvi.KVCacheTensor(size=size, layers=[names[1], names[3]], layer_stride=page * BLOCKS, block_stride=page),
    ]
    if third is not None:
        groups.append(kvi.KVCacheGroupSpec(["model.layers.4.mixer"], third))
    return kvi.KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups)


def describe_hybrid(config: Any, caches: dict[str, Any], backend: str = "CPU_ATTN") -> dict[str, Any]:
    return lay.describe_kv_caches(
        caches,
        lay.kv_cache_groups(config),
        total_layers=4,
        total_kv_heads=HEADS,
        head_dim=D,
        block_size=N,
        layer_index=layer_index,
        backend=backend,
        num_blocks=BLOCKS,
        local_kv_heads=HEADS,
    )


def test_hybrid_groups_share_one_region_each_with_its_own_window() -> None:
    from vllm.v1.worker.utils import allocate_kv_cache

    config = hybrid_config()
    # vLLM's own allocation, as its model runners make it: one buffer, the groups' views aliasing it.
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    names = sorted(caches, key=layer_index)
    assert caches[names[0]].data_ptr() == caches[names[1]].data_ptr() != caches[names[2]].data_ptr()
    # A 32-token window needs the last 31 tokens after the prompt (vLLM frees the blocks below them).
    assert lay.kv_cache_groups(config) == [([names[0], names[2]], 0), ([names[1], names[3]], 31)]
    d = describe_hybrid(config, caches)
    assert (d["placement"], d["order"], d["num_blocks"]) == ("head_joint", "hnd", BLOCKS)
    # One region per layer, in layer order, layers 0/1 and 2/3 on the same bytes.
    region = BLOCKS * HEADS * N * 2 * D * ES
    assert list(zip(d["region_bases"], d["region_lens"])) == [(caches[n].data_ptr(), region) for n in names]
    assert d["groups"] == [([0, 2], 0), ([1, 3], 31)]
    got = check_native(d)
    # The engine registers each shared region once.
    assert got["distinct_regions"] == 2


def test_hybrid_layers_of_one_group_sharing_a_region_are_refused() -> None:
    from vllm.v1.worker.utils import allocate_kv_cache

    config = hybrid_config()
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    names = sorted(caches, key=layer_index)
    # Layer 2 (group 0) on layer 0's bytes (group 0 too): one group's blocks would collide.
    caches[names[2]] = caches[names[0]]
    with pytest.raises(lay.LayoutUnknown, match=r"CPU_ATTN.*layers model\.layers\.0\..* and model\.layers\.2\..* of one KV cache group share a region"):
        describe_hybrid(config, caches)
    # And the engine's own validation says the same of a description that claims it.
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    d = describe_hybrid(config, caches)
    d["region_bases"][2] = d["region_bases"][0]
    with pytest.raises(kvpush.KvpushError, match="same KV group 0"):
        check_native(d)


def test_mamba_state_is_refused_at_start_up_naming_layer_and_spec() -> None:
    mamba = kvi.MambaSpec(block_size=N, shapes=((4, 8), (16,)), dtypes=(DT, DT))
    with pytest.raises(lay.KvSpecUnsupported, match=r"model\.layers\.4\.mixer has a KV cache spec MambaSpec"):
        lay.kv_cache_groups(hybrid_config(third=mamba))
    # Chunked local attention (a window vLLM's allocator resets per chunk) is refused the same way.
    chunked = kvi.ChunkedLocalAttentionSpec(block_size=N, num_kv_heads=HEADS, head_size=D, dtype=DT, attention_chunk_size=64)
    with pytest.raises(lay.KvSpecUnsupported, match="ChunkedLocalAttentionSpec"):
        lay.kv_cache_groups(hybrid_config(third=chunked))
