"""The connector's topology parts without servers (issue 17, item 4): PP, DP and ranks on several hosts.

- PP: a worker of one pipeline stage sees only its own layers in vLLM's KV cache config; the engine
  plans by global layer, so the connector hands it the grouping of every layer (the engine refused
  the stage's own grouping with "layer N is in no group"). The worker half is fed a PP-shaped
  vllm_config and its config goes through the engine's own validation (``kvpush.check_layout``).
- DP: the engine's side-channel ports are offset by vLLM's ``data_parallel_index`` (TP × PP ports per
  DP engine), and P tells D the port of its own rank 0.
- Ranks on several hosts: each worker publishes its side channel's host and port through vLLM's
  handshake-metadata hooks; P's scheduler hands every rank's address to D (``remote_ranks``), and D's
  workers pass them to the engine instead of assuming ``remote_host:port + r``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
kvpush = pytest.importorskip("kvpush", reason="the kvpush package (maturin develop)")
kv = pytest.importorskip("kvpush.vllm", reason="vLLM")
tr = pytest.importorskip("kvpush._transfer", reason="the kvpush package (maturin develop)")

LAYERS, HEADS, D, N, BLOCKS = 4, 2, 8, 16, 6


def name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def cfg(**kw: Any) -> Any:
    base = dict(
        mode="push", side_channel_host="10.0.0.9", side_channel_listen="0.0.0.0", side_channel_port=5700,
        nixl_backend="UCX", lease_ms=0, timeout_ms=0, peer_timeout_ms=0, writers=1, secret=None,
        insecure=True, device=None, staging="auto",
    )  # fmt: skip
    base.update(kw)
    return kv.KVPushConfig(**base)


def vllm_config(tp: int = 1, pp: int = 1, dp_index: int = 0, layer_types: list[str] | None = None) -> Any:
    hf = SimpleNamespace(num_hidden_layers=LAYERS)
    if layer_types is not None:
        hf.layer_types = layer_types
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="prefill-0"),
        cache_config=SimpleNamespace(block_size=N),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_index=dp_index
        ),
        model_config=SimpleNamespace(
            get_total_num_kv_heads=lambda: HEADS, get_head_size=lambda: D, hf_config=hf, use_mla=False
        ),
    )


class FullAttentionSpec:
    """Stands for vLLM's spec of a full-attention layer (the connector goes by the spec's type name)."""

    sliding_window = None


class SlidingWindowSpec:
    """Stands for vLLM's spec of a sliding-window layer."""

    def __init__(self, sliding_window: int) -> None:
        self.sliding_window = sliding_window


def group(layers: list[int], window: int = 0) -> Any:
    spec = SlidingWindowSpec(window) if window else FullAttentionSpec()
    return SimpleNamespace(layer_names=[name(i) for i in layers], kv_cache_spec=spec)


class _Native:
    """Stands in for ``kvpush.Worker``: keeps the config the connector built."""

    configs: list[dict[str, Any]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        _Native.configs.append(dict(config))
        self.side_channel_port = 6000 + config["tp_rank"]


def start_worker(monkeypatch: pytest.MonkeyPatch, vc: Any, groups: list[Any], pp_rank: int, tp_rank: int = 0) -> Any:
    """The worker half's ``register_kv_caches`` on CPU tensors of this stage's layers, as vLLM's
    FlashAttention lays them out ([2, blocks, N, heads, D]); returns the worker and its engine config."""
    import vllm.distributed.parallel_state as ps

    monkeypatch.setattr(ps, "get_pp_group", lambda: SimpleNamespace(rank_in_group=pp_rank))
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: tp_rank)
    monkeypatch.setattr(kvpush, "Worker", _Native)
    monkeypatch.setattr(kv, "_load_nixl", lambda: None)
    monkeypatch.setattr(kv, "_backend_name", lambda _: "FLASH_ATTN")
    heads = max(HEADS // vc.parallel_config.tensor_parallel_size, 1)
    caches = {
        n: torch.zeros((2, BLOCKS, N, heads, D), dtype=torch.float16) for g in groups for n in g.layer_names
    }
    kcc = SimpleNamespace(kv_cache_groups=groups, num_blocks=BLOCKS)
    w = kv._Worker(vc, kcc, cfg())
    _Native.configs.clear()
    w.register_kv_caches(caches)
    [config] = _Native.configs
    return w, config


def native_layout(config: dict[str, Any]) -> dict[str, Any]:
    """The engine's own validation of the layout part of the connector's config."""
    return kvpush.check_layout({k: v for k, v in config.items() if v is not None})


# ---- PP


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_a_pp_stage_hands_the_engine_every_layer_s_group(monkeypatch: pytest.MonkeyPatch, pp_rank: int) -> None:
    mine = [0, 1] if pp_rank == 0 else [2, 3]
    w, config = start_worker(monkeypatch, vllm_config(pp=2), [group(mine)], pp_rank)
    assert [(list(l), win) for l, win in config["groups"]] == [([0, 1, 2, 3], 0)]
    assert (config["pp_rank"], config["pp_size"], config["total_layers"]) == (pp_rank, 2, LAYERS)
    assert len(config["region_bases"]) == 2 * len(mine)  # K and V of this stage's layers only
    got = native_layout(config)
    assert got["regions"] == 2 * len(mine)
    assert (w.handshake.pp_rank, w.handshake.port) == (pp_rank, 6000)


def test_a_hybrid_pp_stage_places_the_other_stage_s_layers_by_type(monkeypatch: pytest.MonkeyPatch) -> None:
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    w, config = start_worker(monkeypatch, vllm_config(pp=2, layer_types=types), [group([0], 32), group([1])], 0)
    # The engine's window is what vLLM keeps of a 32-token sliding window after the prompt: 31 tokens.
    assert [(list(l), win) for l, win in config["groups"]] == [([0, 2], 31), ([1, 3], 0)]
    native_layout(config)


def test_pp_groups_that_cannot_be_completed_are_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two groups and no layer_types: nothing says where the other stage's layers go.
    with pytest.raises(ValueError, match="PP 2 with 2 KV cache groups needs the model's layer_types"):
        start_worker(monkeypatch, vllm_config(pp=2), [group([0], 32), group([1])], 0)
    # A stage holding other layers than vLLM's even split (VLLM_PP_LAYER_PARTITION).
    with pytest.raises(ValueError, match=r"PP rank 0 of 2 holds layers \[0, 1, 2\], not 0..1"):
        start_worker(monkeypatch, vllm_config(pp=2), [group([0, 1, 2])], 0)


def test_full_layer_groups_follow_vllm_s_split_with_a_remainder() -> None:
    # 5 layers over PP 2: vLLM gives the extra layer to the stage before the last (0-2, 3-4).
    assert kv.full_layer_groups([([0, 1, 2], 0)], 5, 2, 0, None) == [([0, 1, 2, 3, 4], 0)]
    assert kv.full_layer_groups([([3, 4], 0)], 5, 2, 1, None) == [([0, 1, 2, 3, 4], 0)]
    with pytest.raises(ValueError, match=r"holds layers \[2, 3, 4\], not 3..4"):
        kv.full_layer_groups([([2, 3, 4], 0)], 5, 2, 1, None)
    # PP 1: as given.
    assert kv.full_layer_groups([([0, 2], 8), ([1, 3], 0)], 4, 1, 0, None) == [([0, 2], 8), ([1, 3], 0)]


# ---- DP


def test_dp_engines_offset_their_ports_and_p_names_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    _, config = start_worker(monkeypatch, vllm_config(tp=2, dp_index=3), [group([0, 1, 2, 3])], 0, tp_rank=1)
    assert (config["dp_index"], config["side_channel_port"], config["tp_rank"]) == (3, 5700, 1)
    s = kv._Scheduler(vllm_config(tp=2, dp_index=3), None, cfg())
    params = s._decode_params(tr.Transfer("t", "0" * 32, 1), [[1]], 10, list(range(10)))
    # Engine 3's rank 0 listens after engines 0-2's two ports each (the engine adds the rank).
    assert (params["remote_port"], params["tp_size"], params["pp_size"]) == (5706, 2, 1)
    assert "remote_ranks" not in params


# ---- ranks on several hosts


def handshakes(engine: str = "prefill-0") -> dict[tuple[int, int], Any]:
    hosts = {(0, 0): ("10.1.0.1", 5600), (0, 1): ("10.1.0.2", 5600), (1, 0): ("10.1.0.3", 7000), (1, 1): ("fd00::9", 7001)}
    return {(pp, t): kv.KVPushHandshake(engine, t, pp, h, port) for (pp, t), (h, port) in hosts.items()}


def test_p_publishes_every_rank_s_address_from_vllm_s_handshake_metadata() -> None:
    c = object.__new__(kv.KVPushConnector)
    c._worker, c._scheduler = None, kv._Scheduler(vllm_config(tp=2, pp=2), None, cfg())
    c.set_xfer_handshake_metadata_pp_aware(handshakes())
    params = c._scheduler._decode_params(tr.Transfer("t", "0" * 32, 1), [[1]], 10, list(range(10)))
    assert params["remote_ranks"] == ["10.1.0.1:5600", "10.1.0.2:5600", "10.1.0.3:7000", "[fd00::9]:7001"]
    assert (params["tp_size"], params["pp_size"]) == (2, 2)
    # D reads them back exactly.
    t, p = tr.consumer_transfer({**params, "transfer_id": "x"}, "pull")
    assert (p.tp_size, p.pp_size, list(p.ranks)) == (2, 2, params["remote_ranks"])


def test_incomplete_or_foreign_handshake_metadata_falls_back_to_the_port_rule() -> None:
    s = kv._Scheduler(vllm_config(tp=2, pp=2), None, cfg())
    partial = handshakes()
    del partial[(1, 1)]
    s.set_rank_addresses(partial)
    assert s.rank_addrs == []
    s.set_rank_addresses(handshakes("prefill-9"))
    assert s.rank_addrs == []
    # A vLLM that gathers by TP rank only.
    c = object.__new__(kv.KVPushConnector)
    c._worker, c._scheduler = None, kv._Scheduler(vllm_config(tp=2), None, cfg())
    c.set_xfer_handshake_metadata({t: kv.KVPushHandshake("prefill-0", t, 0, "h", 5600 + 10 * t) for t in (0, 1)})
    assert c._scheduler.rank_addrs == ["h:5600", "h:5610"]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (["a:1", "b:2", "c:3"], "not a list of 4 host:port"),
        ("a:1,b:2", "not a list of 4 host:port"),
        (["a:1", "b:2", "c:3", "d"], "has 'd', not host:port"),
        (["a:1", "b:2", "c:3", "d:0"], "has 'd:0', not host:port"),
        (["a:1", "b:2", "c:3", 4], "has 4, not host:port"),
    ],
)
def test_d_refuses_malformed_remote_ranks_without_raising(bad: Any, reason: str) -> None:
    params = {
        "do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "prefill-0", "remote_host": "10.0.0.1",
        "remote_port": 5600, "tp_size": 2, "pp_size": 2, "remote_ranks": bad,
    }  # fmt: skip
    got = tr.consumer_transfer(params, "push")
    assert isinstance(got, tr.Refused) and reason in got.reason, got


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def blocks_allocated(self, *args: Any, **kw: Any) -> None:
        self.calls.append(("blocks_allocated", args, kw))

    def tell_producer(self, *args: Any, **kw: Any) -> None:
        self.calls.append(("tell_producer", args, kw))


def test_d_hands_the_engine_p_s_published_ranks_and_pp_size() -> None:
    from types import SimpleNamespace as NS

    s = kv._Scheduler(vllm_config(), None, cfg())
    ranks = ["10.1.0.1:5600", "10.1.0.2:5600", "10.1.0.3:7000", "10.1.0.4:7001"]
    params = {
        "do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "prefill-0", "remote_host": "10.1.0.1",
        "remote_port": 5600, "tp_size": 2, "pp_size": 2, "remote_ranks": ranks,
    }  # fmt: skip
    req = NS(request_id="r1", prompt_token_ids=list(range(40)), kv_transfer_params=dict(params))
    matched = s.get_num_new_matched_tokens(req, 0)
    blocks = NS(get_unhashed_block_ids_all_groups=lambda: [[7, 8, 9]])
    s.update_state_after_alloc(req, blocks, matched[0])
    # Its own transfer: a request naming a transfer another request registered is vLLM's rejection
    # stand-in, not a drop (test_connector_lifecycle.py).
    own = {**params, "transfer_id": "t2"}
    dropped = NS(request_id="r2", prompt_token_ids=list(range(40)), kv_transfer_params=own, status=None)
    s.get_num_new_matched_tokens(dropped, 0)
    s.request_finished(dropped, ([],))
    meta = s.build_connector_meta(NS(scheduled_new_reqs=[], num_scheduled_tokens={}))
    w = object.__new__(kv._Worker)
    from kvpush._outcomes import OutcomeMatcher

    w.native, w.blocks_per_block, w.kernel_tokens, w.outcomes = _Recorder(), 1, N, OutcomeMatcher()
    w.stats, w.load_errors, w._pending_sent, w._pending_failed = kv.KVPushStats(), set(), set(), {}
    w.start_load_kv(meta)
    where = {"producer_pp": 2, "producer_ranks": ranks}
    assert [(c[0], c[1][2:6] if c[0] == "blocks_allocated" else c[1][3:7], c[2]) for c in w.native.calls] == [
        ("tell_producer", ("prefill-0", "10.1.0.1", 5600, 2), where),
        ("blocks_allocated", ("prefill-0", "10.1.0.1", 5600, 2), where),
    ]
