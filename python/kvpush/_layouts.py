"""vLLM's per-layer KV cache tensors → the engine's layout keys, judged by strides, not shapes.

Read :func:`describe_kv_caches`. vLLM hands the connector one tensor per attention layer; what its bytes
mean depends on the attention backend. Every layout below is recognised from the tensor's shape *and*
strides (so a permuted view is read as the memory it is, never as the shape it shows) and the model's
facts (head size, block size, MLA or not), with the backend's name deciding only what strides cannot:

============================  ======================================  ==========================
backend (vLLM)                per-layer tensor (logical shape)         engine placement / order
============================  ======================================  ==========================
FlashAttention (≤0.2x)        ``[2, blocks, N, heads, D]``             ``separate``, NHD or HND
FlashInfer, Triton (≤0.2x)    ``[blocks, 2, N, heads, D]``             ``joint``, NHD or HND
CPU_ATTN                      ``[blocks, heads, N, 2·D]``              ``head_joint``, HND
GPU backends (0.3x pages)     ``[blocks, heads, N, K‖V]``              ``cell_joint``, HND or NHD
MLA (any version)             ``[blocks, N, L]`` / ``[blocks, 1, N, L]`` ``single`` latent
============================  ======================================  ==========================

NHD or HND is read from the strides of the token and head axes. ``N`` may be a *kernel* block smaller
than vLLM's block (``block_size`` = ``N`` × ratio, ``blocks`` = vLLM's blocks × ratio): the engine then
works in kernel blocks and the connector expands each vLLM block id ``b`` to ``b·ratio … b·ratio +
ratio − 1`` (:func:`expand_block_ids`), as vLLM's own connectors do. Layers of different KV cache
groups sharing one tensor (vLLM's hybrid allocator) share one region. Anything else — a block that is not
dense, layers sharing blocks (block-outermost 0.3x layouts), an axis that fits no rule — is a
:class:`LayoutUnknown` at start-up naming the backend, shape and strides; a group of state kvpush does not
move (Mamba) a :class:`KvSpecUnsupported` (:func:`kv_cache_groups`).

Pure torch with no vLLM import: tests/python/test_connector_layouts.py builds each backend's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvpush._neuron import tensor_device

_TORCH_DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.uint8: "uint8",
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _TORCH_DTYPES[getattr(torch, _name)] = _name

# Backends whose 4-D ``[blocks, heads, N, 2·D]`` holds, per head, its K tokens then its V tokens.
HEAD_JOINT_BACKENDS = ("CPU_ATTN", "TORCH_SDPA", "CPU")


class LayoutUnknown(ValueError):
    """The KV cache tensors fit no layout the connector knows; the message names backend and shape."""


class KvSpecUnsupported(ValueError):
    """A KV cache group holds state kvpush cannot move (Mamba/SSM, chunked local attention, ...); the
    message names the layer and the spec."""


# vLLM's KV cache specs whose blocks hold one token's K and V (or MLA latent) per slot, addressed by
# the group's block ids: full attention everywhere, a sliding window of the last ``sliding_window``
# tokens. Anything else (MambaSpec's per-request state, chunked local attention, sinks, cross
# attention, HiSparse pools) is refused at start-up by :func:`kv_cache_groups`.
_FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_WINDOW_SPECS = ("SlidingWindowSpec", "SlidingWindowMLASpec")


def _spec_window(spec: Any, layer: str) -> int:
    """The sliding window of one layer's spec in tokens (0: full attention), or
    :class:`KvSpecUnsupported` naming ``layer`` and the spec."""
    name = type(spec).__name__
    if name in _FULL_SPECS:
        return 0
    if name in _WINDOW_SPECS:
        # The token at position p attends to p - W + 1 .. p: after n computed tokens the next one needs
        # the last W - 1 (vLLM frees the blocks below, SlidingWindowManager.get_num_skipped_tokens),
        # plus the trailing tokens vLLM retains for speculative decoding.
        return max(int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0), 1)
    raise KvSpecUnsupported(
        f"kvpush: layer {layer} has a KV cache spec {name} ({spec}); kvpush moves full-attention, MLA and "
        "sliding-window KV blocks only (Mamba/SSM state, chunked local attention and the like are not "
        "moved). Serve this model without kvpush, or disaggregate it with a connector that moves its state"
    )


def kv_cache_groups(kv_cache_config: Any) -> list[tuple[list[str], int]]:
    """Each of vLLM's KV cache groups (``kv_cache_config.kv_cache_groups``) as its layer names and the
    tokens its window needs (0: full attention; ``sliding_window - 1``: what vLLM keeps of a sliding
    window after a request's prompt, the block holding the token before is already freed on P), for
    :func:`describe_kv_caches`.

    vLLM's hybrid allocator gives every group its own block table and lets the groups' tensors alias
    one allocation (a block id belongs to one group at a time): kvpush moves each group's blocks by
    its own ids, a sliding-window group only its window. A group whose spec is anything else — Mamba's
    per-request SSM state above all — is a :class:`KvSpecUnsupported` at start-up naming the layer and
    the spec, rather than a model served with state nobody moved.
    """
    groups = []
    for g in kv_cache_config.kv_cache_groups:
        names = list(g.layer_names)
        spec = g.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
        if isinstance(inner, dict):
            windows = {_spec_window(inner[n], n) for n in names if n in inner}
            if len(windows) > 1:
                raise KvSpecUnsupported(
                    f"kvpush: the layers {names} of one KV cache group have different sliding windows "
                    f"{sorted(windows)}; kvpush plans one window per group"
                )
            window = windows.pop() if windows else 0
        else:
            window = _spec_window(spec, names[0] if names else "<none>")
        groups.append((names, window))
    return groups


@dataclass(frozen=True)
class _Found:
    placement: str
    order: str
    kv_kind: str  # key_value | latent
    heads: int  # local heads (1 for latent)
    width: int  # head dim (latent width)
    block_tokens: int  # per engine block (a kernel block when split)
    blocks: int  # engine blocks per region
    block_stride: int  # elements
    parts: list[Callable[[torch.Tensor], torch.Tensor]]  # the region(s) of a layer tensor


def _dense(t: torch.Tensor, axes: tuple[int, ...]) -> bool:
    """Whether ``axes`` (outer to inner) of ``t`` are packed with no gap, innermost stride 1."""
    want = 1
    for a in reversed(axes):
        if t.shape[a] != 1 and t.stride(a) != want:
            return False
        want *= t.shape[a]
    return True


def _token_order(t: torch.Tensor, n_axis: int, h_axis: int) -> str:
    """``hnd`` when heads are outer to tokens in memory, else ``nhd`` (equal when one is 1 wide)."""
    if t.shape[h_axis] == 1 or t.shape[n_axis] == 1:
        return "hnd"
    return "hnd" if t.stride(h_axis) > t.stride(n_axis) else "nhd"


def _inner(order: str, n_axis: int, h_axis: int, last: int) -> tuple[int, ...]:
    return (h_axis, n_axis, last) if order == "hnd" else (n_axis, h_axis, last)


def _candidates(
    t: torch.Tensor, mla: bool, head_dim: int, block_size: int, heads: int | None, cpu: bool
) -> list[_Found]:
    """Every layout rule ``t`` satisfies (strides included). ``heads``: the rank's KV heads, if known."""
    s = tuple(t.shape)
    out: list[_Found] = []

    def fits(n_axis: int, h_axis: int | None) -> bool:
        n_ok = s[n_axis] > 0 and block_size % s[n_axis] == 0  # a block, or a kernel block of one
        return n_ok and (h_axis is None or heads is None or s[h_axis] == heads)

    if mla:
        # [blocks, N, L] or [blocks, 1, N, L]: one latent vector per token.
        n_axis = len(s) - 2
        if len(s) in (3, 4) and (len(s) == 3 or s[1] == 1) and fits(n_axis, None):
            if _dense(t, (n_axis, n_axis + 1)) and t.stride(0) >= s[n_axis] * s[-1]:
                out.append(_Found("single", "hnd", "latent", 1, s[-1], s[n_axis], s[0], t.stride(0), [_whole]))
        return out

    if len(s) == 5 and s[4] == head_dim:
        # [2, blocks, N, H, D] (K and V regions) and [blocks, 2, N, H, D] (K then V in each block):
        # vLLM's logical shapes, N and H in either memory order, D innermost. A tensor shown in its
        # physical order ([.., H, N, D]) is read so only when the logical reading does not fit.
        for kv_axis in (0, 1):
            if s[kv_axis] != 2:
                continue
            axes = [(n, h) for n, h in ((2, 3), (3, 2)) if fits(n, h)]
            for n_axis, h_axis in axes:
                order = _token_order(t, n_axis, h_axis)
                if not _dense(t, _inner(order, n_axis, h_axis, 4)):
                    continue
                part = s[2] * s[3] * s[4]
                heads, tokens = s[h_axis], s[n_axis]
                if kv_axis == 0 and t.stride(1) >= part and t.stride(0) >= s[1] * t.stride(1):
                    # Each of K and V is its own region of blocks.
                    out.append(_Found("separate", order, "key_value", heads, s[4], tokens, s[1], t.stride(1), [_k, _v]))
                    break
                if kv_axis == 1 and t.stride(1) == part and t.stride(0) >= 2 * part:
                    # Each block holds its K part then its V part.
                    out.append(_Found("joint", order, "key_value", heads, s[4], tokens, s[0], t.stride(0), [_whole]))
                    break
        return out

    if len(s) == 4 and s[3] == 2 * head_dim and fits(2, 1):
        # [blocks, H, N, 2·D]: vLLM CPU's per-head K tokens then V tokens, or a GPU page of K‖V cells.
        order = _token_order(t, 2, 1)
        if _dense(t, _inner(order, 2, 1, 3)) and t.stride(0) >= s[1] * s[2] * s[3]:
            if not cpu:
                out.append(_Found("cell_joint", order, "key_value", s[1], head_dim, s[2], s[0], t.stride(0), [_whole]))
            elif order == "hnd":
                out.append(_Found("head_joint", "hnd", "key_value", s[1], head_dim, s[2], s[0], t.stride(0), [_whole]))
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def _k(t: torch.Tensor) -> torch.Tensor:
    return t[0]


def _v(t: torch.Tensor) -> torch.Tensor:
    return t[1]


def _unknown(backend: str | None, t: torch.Tensor, block_size: int, head_dim: int, why: str) -> LayoutUnknown:
    return LayoutUnknown(
        f"kvpush: attention backend {backend or 'unknown'} gives KV cache tensors of shape {tuple(t.shape)}, "
        f"strides {tuple(t.stride())}, dtype {t.dtype} (block size {block_size}, head size {head_dim}): {why}. "
        "Known layouts are listed in docs/vllm.md ('KV cache layouts')"
    )


def _check_shared(
    backend: str | None,
    first: torch.Tensor,
    block_size: int,
    head_dim: int,
    spans: list[tuple[int, int, str]],
    group_of: dict[str, int],
) -> None:
    """Regions (base, length, layer) sorted by base may be one region shared by layers of different
    KV groups (vLLM's hybrid allocator: each group reaches its own blocks in it); any other overlap is
    a :class:`LayoutUnknown`."""
    for i, (a, la, na) in enumerate(spans):
        for b, lb, nb in spans[i + 1 :]:
            if b >= a + la:
                break
            if (a, la) != (b, lb):
                raise _unknown(
                    backend, first, block_size, head_dim,
                    "layers share blocks (their regions overlap: a block-outermost layout); kvpush needs each "
                    "layer's blocks in a region of their own (VLLM_KV_CACHE_LAYOUT=LBHNC)",
                )  # fmt: skip
            if group_of.get(na) == group_of.get(nb):
                raise _unknown(
                    backend, first, block_size, head_dim,
                    f"layers {na} and {nb} of one KV cache group share a region (their blocks would be the same "
                    "bytes); kvpush shares a region only between layers of different groups",
                )  # fmt: skip


def describe_kv_caches(
    kv_caches: dict[str, torch.Tensor],
    layer_groups: list[tuple[list[str], int]],
    *,
    total_layers: int,
    total_kv_heads: int,
    head_dim: int,
    block_size: int,
    layer_index: Any,
    backend: str | None = None,
    mla: bool = False,
    num_blocks: int | None = None,
    local_kv_heads: int | None = None,
) -> dict[str, Any]:
    """The engine's layout keys for vLLM's per-layer KV cache tensors (see the module docs).

    ``layer_groups`` is each KV cache group's layer names with its sliding window in tokens (0: full
    attention; :func:`kv_cache_groups` reads them from vLLM's config). Layers of different groups may
    share one tensor (vLLM's hybrid allocator): their regions are then the same and the engine reaches
    each group's blocks in it by that group's ids. ``block_size`` is vLLM's block size in tokens; ``backend`` the attention backend's name
    (``get_name()``); ``mla`` whether the model keeps a latent cache; ``num_blocks`` vLLM's block count
    and ``local_kv_heads`` this rank's KV heads (each checked when given: they tell the block and head
    axes apart when their sizes could be either). Keys starting with ``_`` are for the connector, not the engine:
    ``_local_heads``, ``_device`` and ``_blocks_per_block`` (kernel blocks per vLLM block).
    Raises :class:`LayoutUnknown` when the tensors fit no known layout, or fit several.
    """
    names = sorted(kv_caches, key=layer_index)
    first = kv_caches[names[0]]
    dtype = _TORCH_DTYPES.get(first.dtype)
    if dtype is None:
        raise _unknown(backend, first, block_size, head_dim, f"dtype {first.dtype} is not supported")
    cpu = (backend or "").upper() in HEAD_JOINT_BACKENDS or (backend is None and not first.is_cuda)
    found = _candidates(first, mla, head_dim, block_size, local_kv_heads, cpu)
    if num_blocks is not None:
        found = [f for f in found if f.blocks == num_blocks * (block_size // f.block_tokens)]
    if not found:
        raise _unknown(backend, first, block_size, head_dim, "no known layout has these sizes and strides")
    if len({(f.placement, f.order, f.heads, f.block_tokens) for f in found}) > 1:
        raise _unknown(
            backend, first, block_size, head_dim,
            "it fits several layouts ({})".format(", ".join(f"{f.placement}/{f.order}" for f in found)),
        )  # fmt: skip
    f = found[0]
    ratio = block_size // f.block_tokens
    if f.blocks % ratio:
        raise _unknown(backend, first, block_size, head_dim, f"{f.blocks} kernel blocks are not {ratio} per block")
    es = first.element_size()
    group_of = {n: gi for gi, (layer_names, _) in enumerate(layer_groups) for n in layer_names}
    bases: list[int] = []
    lens: list[int] = []
    owners: list[str] = []
    for n in names:
        t = kv_caches[n]
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise _unknown(backend, t, block_size, head_dim, f"layer {n} differs from layer {names[0]}")
        for part in f.parts:
            region = part(t)
            bases.append(region.data_ptr())
            lens.append(f.blocks * f.block_stride * es)
            owners.append(n)
    _check_shared(backend, first, block_size, head_dim, sorted(zip(bases, lens, owners)), group_of)
    groups = []
    for layer_names, window in layer_groups:
        layers = sorted({int(layer_index(n)) for n in layer_names if n in kv_caches})
        if layers:
            groups.append((layers, int(window)))
    return {
        "total_layers": total_layers,
        "kv_heads": 1 if f.kv_kind == "latent" else total_kv_heads,
        "head_dim": f.width,
        "dtype": dtype,
        "kv_kind": f.kv_kind,
        "block_tokens": f.block_tokens,
        "num_blocks": int(f.blocks),
        "order": f.order,
        "placement": f.placement,
        "block_stride": int(f.block_stride * es),
        "region_bases": bases,
        "region_lens": lens,
        "groups": groups,
        "_local_heads": int(f.heads),
        "_blocks_per_block": int(ratio),
        # The GPU this rank's KV cache is on (each TP rank has its own; the engine opens that one),
        # "neuron" for a cache in Neuron device memory, else "host".
        "_device": tensor_device(first),
    }


def expand_block_ids(
    groups: list[list[int]], ratio: int, num_tokens: int = 0, kernel_tokens: int = 0
) -> list[list[int]]:
    """vLLM block ids → the engine's kernel block ids: ``b`` becomes ``b·ratio … b·ratio + ratio − 1``.

    Given the request's exact ``num_tokens`` and the ``kernel_tokens`` of a kernel block, each list
    (the *last* blocks of the request) also loses the kernel blocks of its last vLLM block past the
    request's last token: the engine takes at most ``ceil(num_tokens / kernel_tokens)`` blocks."""
    if ratio == 1:
        return groups
    out = [[b * ratio + i for b in g for i in range(ratio)] for g in groups]
    if num_tokens <= 0 or kernel_tokens <= 0:
        return out
    unused = -(-num_tokens // (ratio * kernel_tokens)) * ratio - -(-num_tokens // kernel_tokens)
    return [g[: max(len(g) - unused, 0)] for g in out]
