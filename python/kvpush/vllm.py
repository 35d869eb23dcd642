"""kvpush as a vLLM KV connector: ``KVPushConnector`` (``KVConnectorBase_V1``, hybrid-KV aware).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush.vllm",
                           "kv_role": "kv_producer", "engine_id": "prefill-0",
                           "kv_connector_extra_config": {"mode": "push", "side_channel_port": 5600}}'

This module is glue. The scheduler half turns vLLM's request life cycle into four lists carried to the
workers in the step's metadata — blocks ready on P, registrations (push) or reads (pull) on D, aborts —
and frees blocks when the workers report outcomes. The worker half hands those lists to the native
engine (``kvpush._native.Worker``: rendezvous, leases, planning, descriptor merging, NIXL posts and
completion counting all happen there, on Rust writer threads) and turns its outcomes into vLLM's finished
sets and invalid-block reports. Requests are matched across P and D by the router's ``transfer_id`` (any
string; without one, P's request id, which P hands back to D) and ``attempt``: kvpush/_transfer.py reads
``kv_transfer_params`` without ever raising and maps each id to the engine's 32-hex key.
docs/vllm.md documents every ``kv_connector_extra_config`` key.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from kvpush._metrics import EngineFigures, KVPushPromMetrics, KVPushStats
from vllm.logger import init_logger

from kvpush._layouts import describe_kv_caches, expand_block_ids, kv_cache_groups
from kvpush import _neuron
from kvpush import _timeline as timeline
from kvpush._outcomes import OutcomeMatcher
from kvpush._transfer import (
    Producer,
    Refused,
    Transfer,
    consumer_transfer,
    is_consumer,
    is_producer,
    producer_transfer,
    prompt_digest,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# kv_transfer_config.kv_buffer_device values the connector knows (docs/vllm.md).
KV_BUFFER_DEVICES = ("cuda", "cpu")

# Extra-config keys and their defaults (docs/vllm.md explains each).
DEFAULTS: dict[str, Any] = {
    "mode": "push",
    "side_channel_host": "127.0.0.1",
    "side_channel_listen": "0.0.0.0",
    "side_channel_port": 5600,
    # None: LIBFABRIC where the KV cache is on Neuron, UCX elsewhere (_neuron.backend).
    "nixl_backend": None,
    "lease_ms": 0,
    "timeout_ms": 0,
    "peer_timeout_ms": 15000,
    "writers": 1,
    "secret": None,
    "insecure": False,
    "dial_allow": None,
    "device": None,
    "staging": "auto",
    # This worker's memory offer in its handshakes (docs/deployment.md §4), e.g. "neuron,device=none":
    # where the NIC cannot reach the KV's device memory, WRITEs go through host slots. None: no offer.
    "memory_offer": None,
    # Push layer by layer from save_kv_layer (docs/vllm.md): "off" (the whole request after its last
    # layer), "on", or "auto" (the engine sends requests below 512 tokens whole).
    "layerwise": "off",
    # D: on a step with nothing to compute while requests wait for their KV, the worker waits up to
    # this long for a transfer to end instead of returning at once (docs/vllm.md, "Idle steps"); 0: off.
    "idle_wait_ms": 4.0,
}

LAYERWISE = ("auto", "on", "off")

@dataclass
class KVPushConfig:
    """The connector's settings, from ``kv_connector_extra_config``."""

    mode: str
    side_channel_host: str
    side_channel_listen: str
    side_channel_port: int
    nixl_backend: str | None
    lease_ms: int
    timeout_ms: int
    peer_timeout_ms: int
    writers: int
    secret: str | None
    insecure: bool
    device: str | None
    staging: str
    # vLLM's kv_transfer_config.kv_buffer_device: where the KV the connector moves lives.
    kv_buffer_device: str = "cpu"
    # The producers D may dial (``_dial_allow``); None: the engine's default.
    dial_allow: str | None = None
    # The memory offer (``memory_offer``), checked by the engine at start-up; None: none.
    memory_offer: str | None = None
    # ``layerwise``: one of LAYERWISE.
    layerwise: str = "off"
    # ``idle_wait_ms``: D's wait for a transfer's end on a step that computes nothing.
    idle_wait_ms: float = 4.0

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> KVPushConfig:
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        extra = dict(ktc.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(DEFAULTS))
        if unknown:
            raise ValueError(
                f"kvpush: unknown kv_connector_extra_config keys {unknown}; known: {sorted(DEFAULTS)}"
            )
        values = {k: extra.get(k, v) for k, v in DEFAULTS.items()}
        if values["mode"] not in ("push", "pull"):
            raise ValueError(f"kvpush: mode must be 'push' or 'pull', got {values['mode']!r}")
        if str(values["staging"]).lower() not in ("auto", "on", "off"):
            raise ValueError(f"kvpush: staging must be 'auto', 'on' or 'off', got {values['staging']!r}")
        layerwise = values["layerwise"]
        if not isinstance(layerwise, str) or layerwise.lower() not in LAYERWISE:
            raise ValueError(f"kvpush: layerwise must be one of {', '.join(LAYERWISE)}, got {layerwise!r}")
        if layerwise.lower() != "off" and values["mode"] != "push":
            raise ValueError(f"kvpush: layerwise {layerwise!r} needs mode 'push' (pull reads after prefill)")
        # One meaning of "secret" everywhere (docs/security.md): unset here means $KVPUSH_SECRET, and
        # an empty one is refused by the engine; insecure mode is only ever explicit.
        if values["secret"] is None:
            values["secret"] = os.environ.get("KVPUSH_SECRET")
        if not isinstance(values["insecure"], bool):
            raise ValueError(f"kvpush: insecure must be true or false, got {values['insecure']!r}")
        buffer = str(getattr(ktc, "kv_buffer_device", None) or "").strip().lower()
        if buffer not in KV_BUFFER_DEVICES:
            raise ValueError(
                f"kvpush: kv_buffer_device {buffer!r} is not one it knows; known: {', '.join(KV_BUFFER_DEVICES)}"
            )
        idle_wait = values["idle_wait_ms"]
        if isinstance(idle_wait, bool) or not isinstance(idle_wait, (int, float)) or not 0 <= idle_wait <= 100:
            raise ValueError(f"kvpush: idle_wait_ms must be a number of milliseconds from 0 to 100, got {idle_wait!r}")
        offer = values["memory_offer"]
        if offer is not None and not isinstance(offer, str):
            raise ValueError(f"kvpush: memory_offer must be a string such as 'neuron,device=none', got {offer!r}")
        return cls(
            memory_offer=offer,
            mode=values["mode"],
            side_channel_host=str(values["side_channel_host"]),
            side_channel_listen=str(values["side_channel_listen"]),
            side_channel_port=int(values["side_channel_port"]),
            nixl_backend=None if values["nixl_backend"] is None else str(values["nixl_backend"]),
            lease_ms=int(values["lease_ms"]),
            timeout_ms=int(values["timeout_ms"]),
            peer_timeout_ms=int(values["peer_timeout_ms"]),
            writers=int(values["writers"]),
            secret=values["secret"],
            insecure=values["insecure"],
            dial_allow=_dial_allow(values["dial_allow"]),
            device=values["device"],
            staging=str(values["staging"]).lower(),
            kv_buffer_device=buffer,
            layerwise=layerwise.lower(),
            idle_wait_ms=float(idle_wait),
        )


# ---------------------------------------------------------------------------------------------------
# Scheduler → worker metadata. ``transfer_id`` here is always the engine's key (``_transfer.transfer_key``:
# 32 hex digits), which is also what the engine's outcomes name.


@dataclass
class Finished:
    """P: prefill of ``req_id`` finished; its blocks hold the transfer's KV."""

    req_id: str
    transfer_id: str
    attempt: int
    block_ids: list[list[int]]
    num_tokens: int
    consumer: str | None = None  # the decode engine the router chose (None: the first to register)


@dataclass
class ToProducer:
    """D: a request and where its producer listens. Alone, a word to the producer about a request that
    has no blocks here yet: in ``dropped``, it ended before its blocks were allocated (aborted while it
    waited in vLLM's queue), so P frees its blocks now rather than when its lease ends; in ``holds``, it
    still waits, so P restarts its lease."""

    req_id: str
    transfer_id: str
    attempt: int
    producer: str
    host: str
    port: int
    producer_tp: int
    # The producer's PP size and each of its ranks' ``host:port`` where it published them (empty:
    # rank r at ``host:port + r``); see ``_transfer.Producer``.
    producer_pp: int = field(default=1, kw_only=True)
    producer_ranks: tuple[str, ...] = field(default=(), kw_only=True)

    def where(self) -> dict[str, Any]:
        """The native calls' keyword arguments naming the producer's ranks (none where the defaults,
        PP 1 and rank r at ``port + r``, apply)."""
        out: dict[str, Any] = {}
        if self.producer_pp != 1:
            out["producer_pp"] = self.producer_pp
        if self.producer_ranks:
            out["producer_ranks"] = list(self.producer_ranks)
        return out


@dataclass
class Receive(ToProducer):
    """D: blocks allocated for ``req_id``; register them (push) or read into them (pull)."""

    block_ids: list[list[int]]
    num_tokens: int
    remote_block_ids: list[list[int]] | None = None
    # Pull: the tokens per block of ``remote_block_ids`` (P's vLLM block size); None: P did not say.
    remote_block_size: int | None = None


@dataclass
class Abort:
    """Either side: the request ended early; the transfer must stop and release its blocks."""

    req_id: str
    transfer_id: str
    attempt: int


@dataclass
class KVPushMetadata(KVConnectorMetadata):
    finished: list[Finished] = field(default_factory=list)
    # P: prefills that end in this step (one output token): handed to the engine right after the
    # forward pass (``wait_for_save``), before vLLM has even seen the sampled token.
    prefilled: list[Finished] = field(default_factory=list)
    receives: list[Receive] = field(default_factory=list)
    aborts: list[Abort] = field(default_factory=list)
    dropped: list[ToProducer] = field(default_factory=list)
    holds: list[ToProducer] = field(default_factory=list)
    # The step computes nothing (vLLM steps only to learn whether a transfer ended): the worker may
    # wait for one (``idle_wait_ms``).
    idle: bool = False


def _dial_allow(value: Any) -> str | None:
    """The producers D may dial (docs/security.md): a list or a comma-separated string of networks and
    host names; unset means ``$KVPUSH_DIAL_ALLOW``, else loopback and the private networks. The engine
    parses it, and refuses a dial to anything else before opening a socket."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    raise ValueError(f"kvpush: dial_allow must be a list of networks and host names, got {value!r}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------
# Topology: where each rank listens, and the layer grouping the engine needs under PP.


@dataclass
class KVPushHandshake(KVConnectorHandshakeMetadata):
    """What a worker publishes through vLLM's handshake-metadata hooks: where its side channel
    listens. vLLM gathers one per (PP rank, TP rank) for the scheduler
    (``set_xfer_handshake_metadata_pp_aware``), which hands them to D in ``remote_ranks``."""

    engine_id: str
    tp_rank: int
    pp_rank: int
    host: str
    port: int


def dp_index(vllm_config: VllmConfig) -> int:
    """This engine's data-parallel index (0 without DP): DP engines of one host each take a block of
    TP × PP side-channel ports."""
    pc = vllm_config.parallel_config
    return int(getattr(pc, "data_parallel_index", None) or getattr(pc, "data_parallel_rank", None) or 0)


def rank0_port(base: int, vllm_config: VllmConfig) -> int:
    """The side-channel port of this engine's rank 0: ``base`` + DP index × TP × PP (the engine adds
    ``pp_rank × TP + tp_rank`` for each rank, src/python/mod.rs)."""
    pc = vllm_config.parallel_config
    return base + dp_index(vllm_config) * int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)


def published_host(cfg: KVPushConfig) -> str:
    """The host this worker tells D to dial: ``$KVPUSH_SIDE_CHANNEL_HOST`` (set per node when an
    engine's ranks span hosts), else ``side_channel_host``."""
    return os.environ.get("KVPUSH_SIDE_CHANNEL_HOST") or cfg.side_channel_host


def rank_addresses(metadata: dict[Any, Any], engine_id: str, tp: int, pp: int) -> list[str]:
    """Every rank's ``host:port`` from vLLM's gathered handshake metadata (keyed ``(pp_rank,
    tp_rank)``), indexed ``pp_rank * tp + tp_rank``, or [] (with the reason logged) when they are not
    all there: D then dials rank r at ``remote_host:remote_port + r``."""
    out: list[str | None] = [None] * (tp * pp)
    for key, m in metadata.items():
        if not isinstance(m, KVPushHandshake) or m.engine_id != engine_id:
            logger.warning("kvpush: handshake metadata %r of rank %s is not this engine's; ignored", m, key)
            return []
        if not (0 <= m.tp_rank < tp and 0 <= m.pp_rank < pp):
            logger.warning("kvpush: handshake metadata of rank tp%s/pp%s outside TP %s × PP %s; ignored",
                           m.tp_rank, m.pp_rank, tp, pp)
            return []
        host = f"[{m.host}]" if ":" in m.host and not m.host.startswith("[") else m.host
        out[m.pp_rank * tp + m.tp_rank] = f"{host}:{m.port}"
    if any(a is None for a in out):
        missing = [i for i, a in enumerate(out) if a is None]
        logger.warning("kvpush: no handshake metadata from ranks %s; D dials rank r at port + r", missing)
        return []
    return [a for a in out if a is not None]


def full_layer_groups(
    local: list[tuple[list[int], int]],
    total_layers: int,
    pp_size: int,
    pp_rank: int,
    layer_types: list[str] | None,
) -> list[tuple[list[int], int]]:
    """The KV groups over every layer of the model, from this PP stage's groups (vLLM gives a
    worker only its own layers). The engine plans across PP stages by global layer, so each group
    must name the other stages' layers too: with one group, every layer is in it; with several, each
    other layer goes to the group of its kind (``layer_types``: sliding-window layers to the one
    group with a window, the rest to the one without). Anything else is refused with the reason.
    """
    if pp_size <= 1 or not local:
        return local
    base, rem = divmod(total_layers, pp_size)
    first_extra = pp_size - 1 - rem  # vLLM's rule: the remainder goes to the stages before the last
    start = pp_rank * base + max(0, min(pp_rank, pp_size - 1) - first_extra)
    length = base + (1 if first_extra <= pp_rank < pp_size - 1 else 0)
    mine = set(range(start, start + length))
    have = {l for layers, _ in local for l in layers}
    if have != mine:
        raise ValueError(
            f"kvpush: PP rank {pp_rank} of {pp_size} holds layers {sorted(have)}, not {start}..{start + length - 1} "
            "as vLLM's even split gives (VLLM_PP_LAYER_PARTITION is not supported)"
        )
    others = [l for l in range(total_layers) if l not in mine]
    if len(local) == 1:
        layers, window = local[0]
        return [(sorted(set(layers) | set(others)), window)]
    windowed = [i for i, (_, w) in enumerate(local) if w > 0]
    full = [i for i, (_, w) in enumerate(local) if w == 0]
    if not layer_types or len(layer_types) != total_layers or len(windowed) != 1 or len(full) != 1:
        raise ValueError(
            f"kvpush: PP {pp_size} with {len(local)} KV cache groups needs the model's layer_types and one "
            "full-attention and one sliding-window group, to place the other stages' layers"
        )
    out = [(list(layers), window) for layers, window in local]
    for l in others:
        out[windowed[0] if "sliding" in str(layer_types[l]) else full[0]][0].append(l)
    return [(sorted(layers), window) for layers, window in out]


# The engine's lease when ``lease_ms`` is 0 (src/proto/rendezvous.rs, RendezvousConfig::default).
ENGINE_LEASE_MS = 30_000
# D: how many of its latest registrations the scheduler half remembers (``_Scheduler.registered``). vLLM's
# rejection stand-in for a request follows that request's end within its HTTP answer.
REGISTERED_MEMORY = 4096


class _Scheduler:
    """The scheduler half. Every method runs in vLLM's scheduler; none blocks."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: KVPushConfig):
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.cfg = cfg
        self.engine_id = str(ktc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        # A group of state kvpush does not move (Mamba) fails the server's start here, naming the layer.
        if kv_cache_config is not None:
            kv_cache_groups(kv_cache_config)
        pc = vllm_config.parallel_config
        self.tp_size = int(pc.tensor_parallel_size)
        self.pp_size = int(pc.pipeline_parallel_size)
        # Rank 0's side-channel port (DP engines each take a block of TP × PP ports), and every rank's
        # host:port once vLLM hands over the workers' handshake metadata ([]: port + rank).
        self.port = rank0_port(cfg.side_channel_port, vllm_config)
        self.rank_addrs: list[str] = []
        self.meta = KVPushMetadata()
        # P: req_id -> transfer (blocks held until the workers report them sent).
        self.sending: dict[str, tuple[str, int]] = {}
        # D: req_id -> transfer (waiting for the KV, or aborted and draining).
        self.receiving: dict[str, tuple[str, int]] = {}
        # P: requests with a transfer id, from scheduling until their prefill is scheduled.
        self.producing: dict[str, Transfer] = {}
        # P, layer-wise: one-token requests whose prompt takes several steps (chunked prefill), until
        # the step that computes their last chunk: req_id -> (transfer, prompt tokens, blocks so far).
        self.chunking: dict[str, tuple[Transfer, int, list[list[int]]]] = {}
        # P: requests handed to the engine at the end of their prefill step that vLLM has not yet
        # finished (``request_finished``): their blocks must not be preempted meanwhile.
        self.released_early: set[str] = set()
        # P: the block ids handed to the engine at the end of the prefill step, per released request. D
        # must name exactly these in pull mode; by ``request_finished`` vLLM has replaced a sliding
        # window's blocks below the window with its null block.
        self.prefilled_blocks: dict[str, list[list[int]]] = {}
        # D: requests that asked for remote KV and wait in vLLM's queue for blocks (req_id -> the word
        # to P, and when to send it next, monotonic seconds). P's lease runs from the end of its
        # prefill; while D queues, D restarts it every third of a lease.
        self.queued: dict[str, tuple[ToProducer, float]] = {}
        # D: the transfers registered lately (transfer key, attempt) -> req_id, the newest
        # REGISTERED_MEMORY: a request vLLM finishes still asking for remote KV whose transfer is one
        # of these is not a drop (``_drop``).
        self.registered: OrderedDict[tuple[str, int], str] = OrderedDict()
        self.hold_every = (cfg.lease_ms or ENGINE_LEASE_MS) / 3000.0
        self.timeline = timeline.SchedulerTrack()

    def _prompt(self, request: Request) -> tuple[int, int]:
        return self._prompt_of(len(request.prompt_token_ids or ()))

    def _prompt_of(self, prompt_tokens: int) -> tuple[int, int]:
        """The tokens to move — the exact prompt length — and the blocks per group that hold them.

        The count is exact, never rounded to whole blocks: a sliding-window group counts its window
        back from it, and a count rounded up would miss the window's first real tokens. Whole blocks
        still move where P's and D's block sizes are equal (the engine's planner widens the tokens to
        them: attention backends may pack tokens inside a block, as vLLM CPU's ISA-specific layouts
        do, so a partial-block copy could garble them; D overwrites the tail slots as it appends).
        """
        return prompt_tokens, _cdiv(prompt_tokens, self.block_size)

    def _consumer(self, request: Request) -> tuple[Transfer, Producer] | None:
        """D: the transfer and producer of a request that asks for remote KV, or None. Params that
        cannot be used are warned about once and dropped: the request is prefilled here."""
        params = request.kv_transfer_params
        if not is_consumer(params):
            return None
        parsed = consumer_transfer(params, self.cfg.mode)
        if isinstance(parsed, Refused):
            logger.warning(
                "kvpush: request %s: kv_transfer_params unusable (%s); prefilling it locally",
                request.request_id,
                parsed.reason,
            )
            params["do_remote_prefill"] = False
            return None
        return parsed

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.timeline.on:
            timeline.scheduler_saw(params)
        if is_producer(params):
            produced = producer_transfer(params, request.request_id)
            if not isinstance(produced, Refused):  # request_finished says why
                self.producing[request.request_id] = produced
        parsed = self._consumer(request)
        if parsed is not None:
            loaded = self._loaded_tokens(request, parsed[1])
            if loaded is None:
                return 0, False
            count = loaded - num_computed_tokens
            if count > 0:
                if request.request_id not in self.queued:
                    note = self._to_producer(request)
                    if note is not None:
                        self.queued[request.request_id] = (note, time.monotonic() + self.hold_every)
                return count, True
        return 0, False

    def _loaded_tokens(self, request: Request, producer: Producer) -> int | None:
        """D: how many of ``request``'s prompt tokens come from its producer: P's prompt length where P
        said it (pull: ``remote_num_tokens``), else the whole prompt. D's prompt may be longer than P's
        (a router's continuation: P's prompt and the token P sampled, so D computes only that token's
        position). A prompt that does not begin with P's tokens (``remote_prompt_digest``) is refused:
        the transfer is dropped at P (its blocks freed now, not at the lease's end), a clear error is
        logged, and D computes the prompt itself (None)."""
        prompt = request.prompt_token_ids or ()
        n = producer.prompt_tokens
        if n is None:
            return len(prompt)
        why = None
        if n > len(prompt):
            why = f"P computed {n} prompt tokens, D's prompt has {len(prompt)}"
        elif producer.prompt_digest is not None and prompt_digest(prompt[:n]) != producer.prompt_digest:
            why = f"D's first {n} prompt tokens are not the ones P computed (remote_prompt_digest differs)"
        if why is None:
            return n
        note = self._to_producer(request)
        request.kv_transfer_params["do_remote_prefill"] = False
        if note is not None:
            self.meta.dropped.append(note)
        logger.error("kvpush: request %s: refusing P's KV: %s; computing the prompt here", request.request_id, why)
        return None

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        parsed = self._consumer(request)
        if parsed is None:
            return
        transfer, producer = parsed
        self.queued.pop(request.request_id, None)
        loaded = self._loaded_tokens(request, producer)
        if loaded is None:
            return
        num_tokens, needed = self._prompt_of(loaded)
        local = [list(g)[:needed] for g in blocks.get_unhashed_block_ids_all_groups()]
        self.meta.receives.append(
            Receive(
                req_id=request.request_id,
                transfer_id=transfer.key,
                attempt=transfer.attempt,
                producer=producer.engine_id,
                host=producer.host,
                port=producer.port,
                producer_tp=producer.tp_size,
                producer_pp=producer.pp_size,
                producer_ranks=producer.ranks,
                block_ids=local,
                num_tokens=num_tokens,
                remote_block_ids=producer.remote_block_ids,
                remote_block_size=producer.remote_block_size,
            )
        )
        self.receiving[request.request_id] = (transfer.key, transfer.attempt)
        self.registered[(transfer.key, transfer.attempt)] = request.request_id
        while len(self.registered) > REGISTERED_MEMORY:
            self.registered.popitem(last=False)
        timeline.record("d_alloc", transfer.key, transfer.attempt)
        # Registered once: a re-entry (preemption, reschedule) must not register again.
        request.kv_transfer_params["do_remote_prefill"] = False

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        rid = request.request_id
        self.timeline.forget(rid)
        self.queued.pop(rid, None)
        if rid in self.receiving:
            # D: a request still waiting for its KV can only finish by being aborted. Peers may still
            # be writing into its blocks: they are freed when the workers report the transfer over.
            tid, attempt = self.receiving[rid]
            self.meta.aborts.append(Abort(rid, tid, attempt))
            return True, None
        if is_consumer(params):
            # D: it still asks for remote KV, so it never got blocks (a registered request stops
            # asking): dropped while queued. P holds the prompt's blocks for it: tell P to free them.
            self._drop(request)
            return False, None
        if not is_producer(params):
            return False, None
        transfer = producer_transfer(params, rid)
        if isinstance(transfer, Refused):
            # Nothing can name this transfer to D: its blocks are freed now, D recomputes or fails.
            logger.warning("kvpush: request %s: kv_transfer_params unusable (%s); not sent", rid, transfer.reason)
            return False, None
        tid, attempt = transfer.key, transfer.attempt
        self.producing.pop(rid, None)
        self.chunking.pop(rid, None)
        if rid in self.released_early:
            # The engine has had its blocks since the end of the prefill step: they stay held until it
            # reports them sent, whatever the outcome; an abort only tells the engine (and so D).
            self.released_early.discard(rid)
            handed = self.prefilled_blocks.pop(rid, None)
            num_tokens, needed = self._prompt(request)
            if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
                self.meta.aborts.append(Abort(rid, tid, attempt))
                return True, None
            timeline.record("p_finished", tid, attempt)
            groups = handed if handed is not None else [list(g)[:needed] for g in block_ids]
            return True, self._decode_params(transfer, groups, num_tokens, request.prompt_token_ids or ())
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            # P: aborted before its KV was complete; D is told and fails or recomputes at once.
            self.meta.aborts.append(Abort(rid, tid, attempt))
            return False, None
        num_tokens, needed = self._prompt(request)
        groups = [list(g)[:needed] for g in block_ids]
        if not any(groups):
            return False, None
        self.meta.finished.append(Finished(rid, tid, attempt, groups, num_tokens, transfer.consumer_engine_id))
        timeline.record("p_finished", tid, attempt)
        self.sending[rid] = (tid, attempt)
        return True, self._decode_params(transfer, groups, num_tokens, request.prompt_token_ids or ())

    def _drop(self, request: Request) -> None:
        """D: ``request`` ended before allocation; its producer is told through the workers."""
        note = self._to_producer(request)
        if note is None:
            return  # nothing names the producer's transfer: its lease ends it
        request.kv_transfer_params["do_remote_prefill"] = False
        owner = self.registered.get((note.transfer_id, note.attempt))
        if owner is not None and owner != request.request_id:
            # vLLM's serving layer answers a request that ended in error (a failed or quarantined load
            # under the "fail" policy: HTTP 500) as one that never reached the engine: it submits a
            # pre-aborted stand-in with the request's kv_transfer_params
            # (AsyncLLM.notify_kv_transfer_request_rejected, abort_immediately) so that this hook frees
            # P. The request did reach us and registered this transfer: P hears of its end from the
            # request's own outcome (its failure or abort), and telling P to drop it is not ours.
            logger.debug(
                "kvpush: request %s: vLLM's rejection stand-in for transfer %s, registered by request %s; "
                "not a drop",
                request.request_id,
                note.transfer_id,
                owner,
            )
            return
        self.meta.dropped.append(note)
        timeline.record("d_dropped", note.transfer_id, note.attempt)
        logger.warning(
            "kvpush: request %s (transfer %s) ended (%s) before its blocks were allocated; producer %s told to "
            "drop it",
            request.request_id,
            note.transfer_id,
            getattr(request.status, "name", request.status),
            note.producer,
        )

    def _to_producer(self, request: Request) -> ToProducer | None:
        parsed = consumer_transfer(request.kv_transfer_params, self.cfg.mode)
        if isinstance(parsed, Refused):
            return None
        t, p = parsed
        return ToProducer(
            request.request_id, t.key, t.attempt, p.engine_id, p.host, p.port, p.tp_size,
            producer_pp=p.pp_size, producer_ranks=p.ranks,
        )

    def _holds(self, meta: KVPushMetadata) -> None:
        """D: tells P to hold on to the requests that still wait here for blocks (each every
        ``hold_every`` seconds while it waits)."""
        now = time.monotonic()
        for rid, (note, due) in list(self.queued.items()):
            if due <= now:
                self.queued[rid] = (note, now + self.hold_every)
                meta.holds.append(note)

    def _decode_params(
        self, transfer: Transfer, groups: list[list[int]], num_tokens: int, prompt: Sequence[int]
    ) -> dict[str, Any]:
        """The ``kv_transfer_params`` P's response carries to D (``prompt``: the request's token ids)."""
        digest = prompt_digest(prompt[:num_tokens])
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            # D maps the id to the same key. vLLM's push proxy relays only remote_request_id (in vLLM's
            # convention P's request id, which is the transfer id here unless a router named one), so
            # both carry the transfer id.
            "transfer_id": transfer.transfer_id,
            "remote_request_id": transfer.transfer_id,
            "attempt": transfer.attempt,
            "remote_engine_id": self.engine_id,
            "remote_host": self.cfg.side_channel_host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            **({"remote_ranks": list(self.rank_addrs)} if self.rank_addrs else {}),
            "remote_block_ids": groups,
            # The tokens per block of remote_block_ids: D's engine expands them to P's kernel blocks
            # with the kernel block size P's workers publish at the handshake (vLLM's name for it).
            "remote_block_size": self.block_size,
            # D loads this many prompt tokens, and checks with the digest that its prompt begins with
            # them (a router's continuation sends D this prompt and the token P sampled).
            "remote_num_tokens": num_tokens,
            **({"remote_prompt_digest": digest} if digest is not None else {}),
            "transfer_mode": self.cfg.mode,
        }

    def set_rank_addresses(self, metadata: dict[Any, Any]) -> None:
        """vLLM's gathered handshake metadata of every worker: each rank's side-channel address."""
        self.rank_addrs = rank_addresses(metadata, self.engine_id, self.tp_size, self.pp_size)
        if self.rank_addrs:
            logger.info("kvpush: engine %s ranks listen at %s", self.engine_id, ", ".join(self.rank_addrs))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPushMetadata:
        meta, self.meta = self.meta, KVPushMetadata()
        if self.producing or self.chunking:
            self._release_prefilled(scheduler_output, meta)
        if self.queued:
            self._holds(meta)
        meta.idle = getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0
        self.timeline.step(scheduler_output)
        return meta

    def _release_prefilled(self, scheduler_output: SchedulerOutput, meta: KVPushMetadata) -> None:
        """P: a request whose whole prompt this step computes and that asks for one token (the
        router's prefill leg) is finished as soon as this step's forward pass ends. Its blocks go to
        the engine then (``wait_for_save``; layer-wise, from each layer's ``save_kv_layer``), a step
        or two before vLLM calls ``request_finished``: until then ``has_pending_block_frees`` keeps
        vLLM from preempting it (its blocks are the engine's to read), and ``request_finished``
        holds them until the engine reports them sent. Layer-wise, a prompt computed over several
        steps (chunked prefill) is followed until the step of its last chunk: only that step makes
        its layers final (the earlier chunks' KV of a layer is final once the last chunk's is)."""
        for new in scheduler_output.scheduled_new_reqs:
            transfer = self.producing.pop(new.req_id, None)
            if transfer is None:
                continue
            prompt = len(new.prompt_token_ids or ())
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            sp = new.sampling_params
            if sp is None or sp.max_tokens != 1 or prompt == 0:
                continue
            groups = [list(g) for g in new.block_ids]
            if new.num_computed_tokens + scheduled < prompt:
                if self.cfg.layerwise != "off":
                    self.chunking[new.req_id] = (transfer, prompt, groups)
                continue
            self._prefilled(meta, new.req_id, transfer, prompt, groups)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if not self.chunking or cached is None:
            return
        for i, rid in enumerate(cached.req_ids):
            entry = self.chunking.get(rid)
            if entry is None:
                continue
            transfer, prompt, groups = entry
            added = cached.new_block_ids[i]
            if added is not None:
                if rid in cached.resumed_req_ids:  # preempted and resumed: its blocks anew
                    groups = [list(g) for g in added]
                else:
                    groups = [g + list(a) for g, a in zip(groups, added)]
            scheduled = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if cached.num_computed_tokens[i] + scheduled < prompt:
                self.chunking[rid] = (transfer, prompt, groups)
                continue
            del self.chunking[rid]
            self._prefilled(meta, rid, transfer, prompt, groups)

    def _prefilled(self, meta: KVPushMetadata, rid: str, transfer: Transfer, prompt: int, groups: list[list[int]]) -> None:
        """P: ``rid``'s prefill ends with this step: its blocks go to the engine with it."""
        num_tokens, needed = self._prompt_of(prompt)
        groups = [g[:needed] for g in groups]
        if not any(groups):
            return
        meta.prefilled.append(Finished(rid, transfer.key, transfer.attempt, groups, num_tokens, transfer.consumer_engine_id))
        self.sending[rid] = (transfer.key, transfer.attempt)
        self.released_early.add(rid)
        self.prefilled_blocks[rid] = groups

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending or ():
            self.sending.pop(rid, None)
        for rid in output.finished_recving or ():
            self.timeline.kv_ready(rid, self.receiving.pop(rid, None))

    def has_pending_block_frees(self) -> bool:
        # While the engine may be reading blocks of a request vLLM still runs, vLLM must wait for
        # free blocks instead of preempting (which would hand those blocks to another request).
        return bool(self.released_early)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping while P holds blocks for D or D waits: outcomes arrive only
        # through get_finished, which runs in a step.
        m = self.meta
        return bool(self.sending or self.receiving or m.finished or m.receives or m.aborts or m.dropped)


# ---------------------------------------------------------------------------------------------------
# The worker half.

_nixl_lock = threading.Lock()
_nixl_loaded: str | None = None


def _load_nixl() -> str | None:
    """Makes sure this process has one libnixl_capi.so (the one Python's nixl would use) before the
    engine's first NIXL call; sets NIXL_PLUGIN_DIR next to it unless set. Returns its path."""
    global _nixl_loaded
    with _nixl_lock:
        if _nixl_loaded is not None:
            return _nixl_loaded
        candidates = []
        override = os.environ.get("KVPUSH_NIXL_LIB_DIR")
        if override:
            candidates.append(override)
        site = [p for p in sys.path if p.endswith("site-packages")]
        for s in site:
            for name in (".nixl_cu13.mesonpy.libs", ".nixl_cu12.mesonpy.libs"):
                candidates.append(os.path.join(s, name))
        for d in candidates:
            lib = os.path.join(d, "libnixl_capi.so")
            if os.path.exists(lib):
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                plugins = os.path.join(d, "plugins")
                if "NIXL_PLUGIN_DIR" not in os.environ and os.path.isdir(plugins):
                    os.environ["NIXL_PLUGIN_DIR"] = plugins
                _nixl_loaded = lib
                return lib
        # Else: LD_LIBRARY_PATH must find it; the engine says so clearly if not.
        return None


def _check_buffer_device(kv_buffer_device: str, from_tensors: str) -> None:
    """Refuses a ``kv_buffer_device`` the KV cache tensors cannot use: ``cuda`` is the GPU memory the
    cache is in (registered as device memory), so a cache in host memory is refused; ``cpu`` is host
    memory: the cache itself in vLLM's CPU build, else a host mirror of a GPU cache
    (:func:`_stages_through_host`)."""
    if from_tensors == _neuron.DEVICE:
        _neuron.check_buffer_device(kv_buffer_device)
        return
    if kv_buffer_device == "cuda" and not from_tensors.startswith("cuda"):
        raise ValueError(
            "kvpush: kv_buffer_device is 'cuda' but the KV cache is in host memory (vLLM's CPU build?): "
            "set kv_buffer_device to 'cpu'"
        )


def _stages_through_host(kv_buffer_device: str, from_tensors: str) -> bool:
    """Whether the engine moves a host mirror of the KV cache rather than the cache: ``cpu`` on a GPU
    (hosts without GPUDirect), vLLM's host-buffer contract (``set_host_xfer_buffer_ops``)."""
    return kv_buffer_device == "cpu" and from_tensors.startswith("cuda")


def _byte_blocks(storage: Any, offset: int, blocks: int, block_bytes: int) -> torch.Tensor:
    """``blocks`` rows of ``block_bytes`` bytes of ``storage`` from byte ``offset``: a region as vLLM's
    block copy wants it, blocks on dimension 0."""
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, offset, (blocks, block_bytes), (block_bytes, 1))


def _device_spec(configured: str | None, from_tensors: str) -> str:
    """The device the engine opens: the configured one, except that ``auto``/``cuda`` (or nothing) on a
    rank whose KV cache is on a GPU becomes that GPU (``cuda:<index>``): TP ranks each have their own."""
    if configured is None or (configured.strip().lower() in ("auto", "cuda") and from_tensors.startswith("cuda:")):
        return from_tensors
    return configured


def _backend_name(vllm_config: VllmConfig) -> str | None:
    """The attention backends' names (``get_name()``), comma-joined, or None when vLLM cannot say."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return ",".join(sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})) or None
    except Exception as e:  # an older vLLM without the helper: the tensors' device decides
        logger.debug("kvpush: attention backend unknown: %s", e)
        return None


class _LayerFeeder:
    """CUDA, layer-wise: hands layers to the engine in order, each once its event completed, from a
    thread of its own, so ``save_kv_layer`` only records an event on the forward path."""

    def __init__(self, ready: Any) -> None:
        import queue

        self._ready = ready
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvpush-layers", daemon=True)
        self._thread.start()

    def submit(self, event: Any, *work: Any) -> None:
        """Calls ``ready(*work)`` once ``event`` (a ``torch.cuda.Event``, recorded) completed."""
        self._queue.put((event, work))

    def _run(self) -> None:
        while True:
            event, work = self._queue.get()
            try:
                event.synchronize()
            except Exception as e:  # the device failed: the layers are not final, nothing is sent
                self._ready(*work, failed=e)
                continue
            self._ready(*work)


class _Worker:
    """The worker half: owns the native engine worker of this rank."""

    # kv_buffer_device "cpu" on a GPU: the engine's regions are host mirrors of the cache's (byte
    # blocks, keyed as ``device_regions``), filled and emptied by vLLM's copy op
    # (set_host_xfer_buffer_ops). None: the engine moves the cache itself.
    host_regions: dict[str, torch.Tensor] | None = None

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: KVPushConfig):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.cfg = cfg
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.engine_id = str(ktc.engine_id)
        self.native: Any = None
        # Kernel blocks per vLLM block (describe_kv_caches): this side's block ids are expanded before
        # the engine; in pull mode P's are expanded by D's engine (``remote_block_size``).
        self.blocks_per_block = 1
        self.kernel_tokens = 0
        # Which request each outcome ends; role "p" or "d".
        self.outcomes = OutcomeMatcher()
        self.load_errors: set[int] = set()
        self.stats = KVPushStats()
        self.figures = EngineFigures()
        # Requests the engine refused outright: reported at the next get_finished.
        self._pending_sent: set[str] = set()
        self._pending_failed: dict[str, list[int]] = {}
        self.on_cuda = False
        # Layer-wise (``layerwise`` not "off"): the global layer number of each KV cache this worker
        # holds, the step's requests that reported layers (req_id -> layers reported), and on CUDA
        # the thread that hands each layer to the engine once its event completed.
        self.layer_of: dict[str, int] = {}
        self._layered: dict[str, set[int]] = {}
        self._kernel_blocks: dict[str, list[list[int]]] = {}
        self._feeder: _LayerFeeder | None = None
        self._lock = threading.Lock()
        self.device_regions: dict[str, torch.Tensor] = {}
        self.copy_blocks: Any = None
        # D with host mirrors: the blocks each (transfer, attempt) receives into, copied to the GPU
        # when the engine reports them received.
        self._staged: dict[tuple[str, int], list[int]] = {}
        # D: requests whose KV failed to load since the last step. vLLM takes block-level load errors
        # only from single-group models: with several KV cache groups it wants the requests
        # (``failed_recving``) and kills its engine core on invalid block ids.
        self.multi_group = len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) > 1
        self.failed_recving: set[str] = set()
        # Where this rank's side channel listens, for vLLM's handshake-metadata hooks.
        self.handshake: KVPushHandshake | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        import kvpush

        mc = self.vllm_config.model_config
        pc = self.vllm_config.parallel_config
        groups = kv_cache_groups(self.kv_cache_config)
        total_heads, tp = int(mc.get_total_num_kv_heads()), int(pc.tensor_parallel_size)
        layout = describe_kv_caches(
            kv_caches,
            groups,
            total_layers=int(mc.hf_config.num_hidden_layers),
            total_kv_heads=total_heads,
            head_dim=int(mc.get_head_size()),
            block_size=int(self.vllm_config.cache_config.block_size),
            layer_index=extract_layer_index,
            backend=_backend_name(self.vllm_config),
            mla=bool(getattr(mc, "use_mla", False)),
            num_blocks=int(self.kv_cache_config.num_blocks),
            local_kv_heads=max(total_heads // tp, 1),
        )
        pp_rank, pp_size = int(get_pp_group().rank_in_group), int(pc.pipeline_parallel_size)
        layout["groups"] = full_layer_groups(
            layout["groups"], int(mc.hf_config.num_hidden_layers), pp_size, pp_rank,
            getattr(mc.hf_config, "layer_types", None),
        )
        device = layout.pop("_device")
        _check_buffer_device(self.cfg.kv_buffer_device, device)
        self.on_cuda = device.startswith("cuda")
        self.layer_of = {name: int(extract_layer_index(name)) for name in kv_caches}
        if _stages_through_host(self.cfg.kv_buffer_device, device):
            if self.cfg.layerwise != "off":
                # The host mirror is filled by one copy before request_finished: a layer pushed as
                # its hook runs would leave from a mirror not yet copied.
                raise ValueError(
                    f"kvpush: layerwise {self.cfg.layerwise!r} needs the KV cache registered where it "
                    f"lives; with kv_buffer_device 'cpu' on {device} blocks go through a host copy "
                    "after prefill: set layerwise 'off'"
                )
            layout["region_bases"] = self._mirror_on_host(kv_caches, layout)
            device = "host"
        layout.pop("_local_heads")
        self.blocks_per_block = layout.pop("_blocks_per_block")
        self.kernel_tokens = int(layout["block_tokens"])
        config = dict(layout)
        config.update(
            engine_id=self.engine_id,
            mode=self.cfg.mode,
            tp_rank=int(get_tensor_model_parallel_rank()),
            tp_size=int(pc.tensor_parallel_size),
            pp_rank=pp_rank,
            pp_size=pp_size,
            dp_index=dp_index(self.vllm_config),
            side_channel_host=self.cfg.side_channel_listen,
            side_channel_port=self.cfg.side_channel_port,
            nixl_backend=_neuron.backend(self.cfg.nixl_backend, device),
            lease_ms=self.cfg.lease_ms,
            timeout_ms=self.cfg.timeout_ms,
            peer_timeout_ms=self.cfg.peer_timeout_ms,
            writers=self.cfg.writers,
            secret=self.cfg.secret,
            insecure=self.cfg.insecure,
            dial_allow=self.cfg.dial_allow,
            device=_device_spec(self.cfg.device, device),
            staging=self.cfg.staging,
            layerwise=self.cfg.layerwise,
        )
        if self.cfg.memory_offer is not None:
            config["memory_offer"] = self.cfg.memory_offer
        lib = _load_nixl()
        kvpush.init_logging()
        self.native = kvpush.Worker(config)
        port = self.native.side_channel_port  # None on the in-process loopback transport (tests)
        if port is not None:
            self.handshake = KVPushHandshake(self.engine_id, config["tp_rank"], pp_rank, published_host(self.cfg), port)
        logger.info(
            "kvpush: %s worker of engine %s (%s mode, %s, %d layers, %d blocks of %d tokens, KV cache groups %s "
            "in %d regions) on side-channel port %s, NIXL %s",
            "tp%d" % config["tp_rank"],
            self.engine_id,
            self.cfg.mode,
            layout["placement"],
            len({l for g in layout["groups"] for l in g[0]}) or layout["total_layers"],
            layout["num_blocks"],
            layout["block_tokens"],
            # e.g. "full [0, 2]; window 96 [1, 3]": what vLLM's allocator built, read by the hybrid tests.
            "; ".join(f"{f'window {w}' if w else 'full'} {layers}" for layers, w in layout["groups"]),
            len(set(layout["region_bases"])),
            self.native.side_channel_port,
            lib or "from LD_LIBRARY_PATH",
        )

    def _mirror_on_host(self, kv_caches: dict[str, torch.Tensor], layout: dict[str, Any]) -> list[int]:
        """Host memory laid out as the KV cache: one host buffer per cache allocation (pinned where
        CUDA is), each region at the same offset as on the GPU. Returns the regions' host bases,
        which the engine registers instead of the cache's."""
        storages: dict[int, tuple[Any, Any]] = {}
        for t in kv_caches.values():
            s = t.untyped_storage()
            if s.data_ptr() not in storages:
                host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                storages[s.data_ptr()] = (s, host.untyped_storage())
        blocks, block_bytes = int(layout["num_blocks"]), int(layout["block_stride"])
        self.host_regions, self.device_regions, bases = {}, {}, []
        for i, (base, length) in enumerate(zip(layout["region_bases"], layout["region_lens"])):
            dev, host = next((d, h) for a, (d, h) in storages.items() if a <= base and base + length <= a + d.nbytes())
            off = base - dev.data_ptr()
            self.device_regions[str(i)] = _byte_blocks(dev, off, blocks, block_bytes)
            self.host_regions[str(i)] = _byte_blocks(host, off, blocks, block_bytes)
            bases.append(host.data_ptr() + off)
        return bases

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """vLLM's block copy between the cache and host buffers (``CopyBlocksOp``); used only when the
        engine moves host mirrors."""
        self.copy_blocks = copy_operation

    def _copy(self, blocks: list[list[int]], direction: str) -> None:
        """Copies ``blocks`` (the engine's block ids, every group) between the cache and its host
        mirror: ``d2h`` before P's engine reads them, ``h2d`` once D's engine has received them."""
        if self.copy_blocks is None:
            raise RuntimeError("kvpush: kv_buffer_device 'cpu' needs vLLM's host-buffer copy (set_host_xfer_buffer_ops)")
        ids = sorted({b for g in blocks for b in g})
        host, device = self.host_regions, self.device_regions
        src, dst = (device, host) if direction == "d2h" else (host, device)
        self.copy_blocks(src, dst, ids, ids, direction)

    def start_load_kv(self, meta: KVPushMetadata) -> None:
        n = self.native
        if n is None:
            return
        for a in meta.aborts:
            try:
                n.abort(a.transfer_id, a.attempt)
            except Exception as e:  # the engine may not know it (never registered): nothing to stop
                logger.debug("kvpush: abort of %s: %s", a.transfer_id, e)
        for word, notes in (("drop", meta.dropped), ("hold", meta.holds)):
            for t in notes:
                try:
                    n.tell_producer(
                        word, t.transfer_id, t.attempt, t.producer, t.host, t.port, t.producer_tp, **t.where()
                    )
                    if word == "drop":
                        self.stats.record("requests_dropped", 1)
                except Exception as e:  # P's lease ends it (a drop), or runs out (a hold: D then recomputes)
                    logger.warning("kvpush: request %s: producer %s not told %r: %s", t.req_id, t.producer, word, e)
        self._release(meta.finished)
        for r in meta.receives:
            self.outcomes.expect(r.transfer_id, r.attempt, r.req_id, "d")
            timeline.record("d_register", r.transfer_id, r.attempt)
            try:
                blocks = expand_block_ids(r.block_ids, self.blocks_per_block, r.num_tokens, self.kernel_tokens)
                if r.remote_block_ids is None:
                    n.blocks_allocated(
                        r.transfer_id, r.attempt, r.producer, r.host, r.port, r.producer_tp, blocks, r.num_tokens,
                        **r.where(),
                    )
                else:
                    # P's ids are its vLLM blocks: the engine expands them to P's kernel blocks with
                    # the kernel block size P published at the handshake (remote_block_tokens).
                    n.start_pull(
                        r.transfer_id,
                        r.attempt,
                        r.producer,
                        r.host,
                        r.port,
                        r.producer_tp,
                        r.remote_block_ids,
                        blocks,
                        r.num_tokens,
                        remote_block_tokens=r.remote_block_size,
                        **r.where(),
                    )
                self.stats.record("requests_registered", 1)
                if self.host_regions is not None:
                    self._staged[(r.transfer_id, r.attempt)] = [b for g in blocks for b in g]
            except Exception as e:
                logger.error("kvpush: request %s (transfer %s) cannot receive: %s", r.req_id, r.transfer_id, e)
                self._pending_failed[r.req_id] = [b for g in r.block_ids for b in g]

    def _release(self, finished: list[Finished]) -> None:
        n = self.native
        if n is None:
            return
        for f in finished:
            self.outcomes.expect(f.transfer_id, f.attempt, f.req_id, "p")
            timeline.record("p_release", f.transfer_id, f.attempt)
            try:
                blocks = expand_block_ids(f.block_ids, self.blocks_per_block, f.num_tokens, self.kernel_tokens)
                if self.host_regions is not None:
                    self._copy(blocks, "d2h")
                n.request_finished(f.transfer_id, f.attempt, blocks, f.num_tokens, consumer_engine_id=f.consumer)
            except Exception as e:
                logger.error("kvpush: request %s (transfer %s) not sent: %s", f.req_id, f.transfer_id, e)
                self._pending_sent.add(f.req_id)

    def save_kv_layer(self, layer_name: str, meta: KVPushMetadata) -> None:
        """Layer-wise: ``layer_name``'s KV of this step is written; for the requests whose prefill
        this step completes, that layer is final. On CPU the engine hears it now; on CUDA an event
        recorded on the current stream marks it, and the feeder thread tells the engine once the
        event completed: the forward pass never waits for the host."""
        if self.cfg.layerwise == "off" or not meta.prefilled or self.native is None:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        for f in meta.prefilled:
            seen = self._layered.setdefault(f.req_id, set())
            if layer in seen:
                continue
            first = not seen
            seen.add(layer)
            if first:
                self.outcomes.expect(f.transfer_id, f.attempt, f.req_id, "p")
                timeline.record("p_release", f.transfer_id, f.attempt)
            self._submit(f, first, [(layer, layer + 1)])

    def _submit(self, f: Finished, first: bool, ranges: list[tuple[int, int]]) -> None:
        """Layers ``ranges`` of ``f`` are final once the work queued so far on the device is done."""
        blocks = self._kernel_blocks.get(f.req_id)
        if blocks is None:
            blocks = expand_block_ids(f.block_ids, self.blocks_per_block, f.num_tokens, self.kernel_tokens)
            self._kernel_blocks[f.req_id] = blocks
        if not self.on_cuda:
            self._layers_ready(f, blocks, first, ranges)
            return
        if self._feeder is None:
            self._feeder = _LayerFeeder(self._layers_ready)
        self._feeder.submit(self._new_event(), f, blocks, first, ranges)

    @staticmethod
    def _new_event() -> Any:
        event = torch.cuda.Event()
        event.record()  # on the current stream, after this layer's KV writes
        return event

    def _layers_ready(
        self,
        f: Finished,
        blocks: list[list[int]],
        first: bool,
        ranges: list[tuple[int, int]],
        failed: Exception | None = None,
    ) -> None:
        n = self.native
        if n is None:
            return
        try:
            if failed is not None:
                raise failed
            for start, end in ranges:
                n.layers_ready(f.transfer_id, f.attempt, blocks, f.num_tokens, start, end, consumer_engine_id=f.consumer)
        except Exception as e:
            logger.error("kvpush: request %s (transfer %s) layers %s not sent: %s", f.req_id, f.transfer_id, ranges, e)
            if first:
                # The engine never took the blocks: vLLM may free them. (After a first call it has:
                # its outcome frees them.)
                with self._lock:
                    self._pending_sent.add(f.req_id)

    def wait_for_save(self, meta: KVPushMetadata) -> None:
        """After the forward pass: the prefills it completed go to the engine now (layer-wise: the
        layers no ``save_kv_layer`` reported, if any)."""
        if not meta.prefilled:
            return
        if self.cfg.layerwise != "off":
            layered, self._layered, self._kernel_blocks = self._layered, {}, {}
            mine = sorted(set(self.layer_of.values()))
            whole = []
            for f in meta.prefilled:
                seen = layered.get(f.req_id)
                if not seen:
                    whole.append(f)
                    continue
                missing = [(l, l + 1) for l in mine if l not in seen]
                if missing:
                    self._submit(f, False, missing)
            if not whole:
                return
            if self.on_cuda and self._feeder is not None:
                # Behind the layers already queued, so a request is never handed over twice apart.
                for f in whole:
                    self.outcomes.expect(f.transfer_id, f.attempt, f.req_id, "p")
                    self._submit(f, True, [(0, max(mine, default=0) + 1)])
                return
            meta = KVPushMetadata(prefilled=whole)
        if self.on_cuda:
            # The forward pass may still be running on the GPU: its KV must be written before a WRITE
            # reads it.
            torch.cuda.current_stream().synchronize()
        self._release(meta.prefilled)

    def idle_wait(self, meta: KVPushMetadata | None) -> bool:
        """D, on a step that computes nothing while this worker waits for KV: blocks until the engine
        has an outcome or ``idle_wait_ms`` has passed (GIL released). vLLM's engine steps about once
        a millisecond while requests wait for remote KV, each step only to call ``get_finished``; on
        its CPU build each is a round trip to this worker process, whose reader spins between steps.
        Waiting here makes such a step cost one sleep, and the step after a landing come at once.
        Returns whether it waited."""
        if meta is None or not meta.idle or self.native is None or self.cfg.idle_wait_ms <= 0:
            return False
        if self._pending_failed or not self.outcomes.expects("d"):
            return False
        with self._lock:
            if self._pending_sent:
                return False
        self.native.wait(self.cfg.idle_wait_ms / 1000.0)
        return True

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._lock:
            sending: set[str] = set(self._pending_sent)
            self._pending_sent.clear()
        recving: set[str] = set()
        for rid, blocks in self._pending_failed.items():
            recving.add(rid)
            self.failed_recving.add(rid)
            self.load_errors.update(blocks)
        self._pending_failed.clear()
        if self.native is None:
            return sending, recving
        for kind, tid, attempt, message, invalid in self.native.poll():
            if kind == "released":
                # A quarantine ends: only now may vLLM free (D) or reuse (P) the request's blocks.
                held = self.outcomes.release(tid, attempt)
                if held is None:
                    logger.debug("kvpush: release of unknown transfer %s attempt %s", tid, attempt)
                    continue
                rid, role = held
                (sending if role == "p" else recving).add(rid)
                if role == "d" and self.multi_group:
                    # vLLM took no block-level errors for this model at the quarantine: the request
                    # fails now, with its release (failed_recving), and its policy applies then.
                    self.failed_recving.add(rid)
                self.stats.record("requests_released", 1)
                logger.warning("kvpush: request %s (transfer %s): quarantined blocks released", rid, tid)
                continue
            owner = self.outcomes.take(tid, attempt)
            if owner is None:
                logger.debug("kvpush: outcome %s for unknown transfer %s attempt %s", kind, tid, attempt)
                continue
            rid, role = owner
            timeline.record(f"{role}_reported", tid, attempt)
            if kind == "quarantined":
                self._quarantine(rid, role, tid, attempt, message, invalid)
            elif role == "p":
                sending.add(rid)
                self.stats.record("requests_sent", 1)
                if message not in ("Sent", ""):
                    logger.warning("kvpush: request %s released without a transfer: %s", rid, message)
            else:
                recving.add(rid)
                staged = None if self.host_regions is None else self._staged.pop((tid, attempt), None)
                if kind == "received" and staged is not None:
                    try:
                        self._copy([staged], "h2d")
                    except Exception as e:  # the KV never reached the GPU: vLLM's load-failure policy
                        kind, message, invalid = "failed", f"copy to the GPU failed: {e}", [staged]
                if kind == "received":
                    self.stats.record("requests_received", 1)
                elif kind == "failed":
                    self.stats.record("requests_failed", 1)
                    self.failed_recving.add(rid)
                    # The engine names kernel blocks; vLLM wants its own block ids.
                    self.load_errors.update(b // self.blocks_per_block for g in invalid for b in g)
                    logger.warning("kvpush: request %s (transfer %s) failed: %s", rid, tid, message)
        return sending, recving

    def _quarantine(
        self, rid: str, role: str, tid: str, attempt: int, message: str, blocks: list[list[int]]
    ) -> None:
        """The request ended, but a lost or silent peer may still write into its blocks: vLLM hears of
        the end now and gets the blocks back only with the engine's "released" (≤ 120 s).

        D: the blocks are reported as load errors now and the request is kept out of
        ``finished_recving`` until "released". vLLM's scheduler then keeps the request in
        WAITING_FOR_REMOTE_KVS, which holds its blocks: with ``kv_load_failure_policy`` ``fail`` it
        ends the request with an error at once and, because its transfer has not finished, delays
        the free (``finish_requests``) until the request shows up in ``finished_recving``; with
        ``recompute`` the request waits, and is recomputed only once released. P: the request stays out of ``finished_sending``, so its
        sources stay held."""
        self.outcomes.quarantine(tid, attempt, (rid, role))
        self.stats.record("requests_quarantined", 1)
        if role == "d":
            self.stats.record("requests_failed", 1)
            self.load_errors.update(b // self.blocks_per_block for g in blocks for b in g)
        logger.error(
            "kvpush: request %s (transfer %s) ended with its blocks quarantined until the engine releases "
            "them: %s",
            rid,
            tid,
            message,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.load_errors = self.load_errors, set()
        # Several KV cache groups: the failed requests go in failed_recving (take_failed) instead.
        return set() if self.multi_group else out

    def take_failed(self) -> set[str]:
        """D: the requests whose KV failed to load since the last call (vLLM's ``failed_recving``)
        where the model has several KV cache groups, else none (their blocks are the load errors)."""
        out, self.failed_recving = self.failed_recving, set()
        return out if self.multi_group else set()

    def take_stats(self) -> KVPushStats | None:
        """The figures since the last call (the engine's transfers and failures, the connector's
        requests), or None when there are none. Never raises into vLLM."""
        if self.native is not None:
            try:
                self.figures.collect(self.native, self.stats)
            except Exception as e:  # the figures of this step are lost, nothing else
                logger.debug("kvpush: engine figures unreadable: %s", e)
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KVPushStats()
        return stats


class KVPushConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's entry point. See the module docs."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        if ktc.engine_id is None:
            raise ValueError("kvpush: kv_transfer_config.engine_id must be set (the router names P by it)")
        self.cfg = KVPushConfig.from_vllm(vllm_config)
        self._scheduler: _Scheduler | None = None
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _Scheduler(vllm_config, kv_cache_config, self.cfg)
        else:
            self._worker = _Worker(vllm_config, kv_cache_config, self.cfg)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Head-major pages (vLLM's LBHNC, as its NIXL connector asks): each head's tokens are one run,
        # so a transfer between different TP sizes moves whole runs. MLA has one head: no preference.
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        return "LBHNC"

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The producer writes every group's blocks of the request.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    # ---- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        if self._worker is not None:
            self._worker.set_host_xfer_buffer_ops(copy_operation)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPushMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPushMetadata)
        self._worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPushMetadata)
        self._worker.wait_for_save(meta)

    def _finished(self) -> tuple[set[str], set[str]]:
        """The worker's finished transfers, after its wait on an idle step (``_Worker.idle_wait``)."""
        assert self._worker is not None
        # vLLM binds the metadata around every step that reaches here; None where nothing is bound.
        meta = getattr(self, "_connector_metadata", None)
        self._worker.idle_wait(meta if isinstance(meta, KVPushMetadata) else None)
        return self._worker.get_finished()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sending, recving = self._finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # vLLM's KVConnectorTransferResults: with several KV cache groups a failed load is reported by
        # request (failed_recving; vLLM refuses block-level errors there), as well as finished.
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        assert self._worker is not None
        sending, recving = self._finished()
        failed = self._worker.take_failed()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving | failed, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        return self._worker.take_stats()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        # Each worker's side-channel address; vLLM gathers them for the scheduler (below).
        return None if self._worker is None else self._worker.handshake

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        if self._scheduler is not None:
            self._scheduler.set_rank_addresses(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        # A vLLM that gathers by TP rank only (no PP).
        self.set_xfer_handshake_metadata_pp_aware({(0, r): m for r, m in metadata.items()})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPushStats(data=data) if data is not None else KVPushStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> KVConnectorPromMetrics | None:
        return KVPushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.native = None


__all__ = ["KVPushConnector", "KVPushConfig", "KVPushMetadata", "describe_kv_caches"]
