"""``kv_transfer_params`` from any router, without servers: ids of any shape, and nothing raises.

The connector's scheduler half runs inside vLLM's scheduler; an exception there stops the server. These
tests feed it what kvpush router, vLLM's own proxies (UUIDs, or no id at all and nulls) and broken clients
send, through the real ``_Scheduler`` with stand-ins for vLLM's request and block objects, and check what
it stages for the workers: D either registers the transfer under the key P uses, or prefills locally;
P either stages the send under that key, or releases the blocks at once.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest

tr = pytest.importorskip("kvpush._transfer", reason="the kvpush package (maturin develop)")
kv = pytest.importorskip("kvpush.vllm", reason="the kvpush package (maturin develop) and vLLM")
from vllm.v1.request import RequestStatus  # noqa: E402

HEX = "0123456789abcdef0123456789abcdef"
BLOCK = 16


# ---- transfer_key


def test_hex_ids_reach_the_engine_unchanged() -> None:
    assert tr.transfer_key(HEX) == HEX
    assert tr.transfer_key(HEX.upper()) == HEX


@pytest.mark.parametrize(
    "tid",
    [
        "123e4567-e89b-12d3-a456-426614174000",  # a UUID as str(uuid4()) writes it
        "cmpl-7f0c2a-0",  # a vLLM request id
        "x",
        "é" * 40,
        "0123456789abcdef0123456789abcde",  # 31 hex digits: not the hex path
        "0123456789abcdef0123456789abcdef0",  # 33
    ],
)
def test_any_other_id_hashes_to_32_hex(tid: str) -> None:
    key = tr.transfer_key(tid)
    assert len(key) == 32 and int(key, 16) >= 0 and key == key.lower()
    assert key != tid.lower()
    assert tr.transfer_key(tid) == key  # deterministic


def test_hash_is_stable_across_processes() -> None:
    # BLAKE2b-128 personalised "kvpush.transfer": P and D (other processes, other machines) agree.
    # The value is written out so a change of hash, which would split P from D across versions, fails.
    assert tr.transfer_key("req-1") == "4c39711a07c64aa6d406146e622a2a0e"


def test_distinct_ids_get_distinct_keys() -> None:
    ids = [str(uuid.uuid4()) for _ in range(2000)] + [f"cmpl-{i}-0" for i in range(2000)]
    keys = {tr.transfer_key(i) for i in ids}
    assert len(keys) == len(ids)
    # A UUID and its own hex digits are different strings, and their keys differ too.
    u = uuid.uuid4()
    assert tr.transfer_key(str(u)) != tr.transfer_key(u.hex)


# ---- the parsers


def d_params(**over: Any) -> dict[str, Any]:
    p = {
        "do_remote_prefill": True,
        "transfer_id": HEX,
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_block_ids": [[1, 2, 3]],
    }
    p.update(over)
    return {k: v for k, v in p.items() if v is not _DROP}


_DROP = object()


def test_consumer_takes_remote_request_id_when_no_transfer_id() -> None:
    parsed = tr.consumer_transfer(d_params(transfer_id=_DROP, remote_request_id="cmpl-abc-0"), "push")
    assert not isinstance(parsed, tr.Refused), parsed
    t, p = parsed
    assert (t.transfer_id, t.key, t.attempt) == ("cmpl-abc-0", tr.transfer_key("cmpl-abc-0"), 1)
    assert (p.engine_id, p.host, p.port, p.tp_size, p.remote_block_ids) == ("prefill-0", "10.0.0.1", 5600, 1, None)


def test_consumer_pull_reads_block_ids_flat_or_per_group() -> None:
    t, p = tr.consumer_transfer(d_params(remote_block_ids=[4, 5]), "pull")
    assert p.remote_block_ids == [[4, 5]]
    t, p = tr.consumer_transfer(d_params(remote_block_ids=[[4, 5], [6]]), "pull")
    assert p.remote_block_ids == [[4, 5], [6]]


def test_consumer_pull_reads_the_block_size_of_ps_ids() -> None:
    # P's vLLM block size, from which D's engine expands P's ids to P's kernel blocks.
    t, p = tr.consumer_transfer(d_params(remote_block_size=64), "pull")
    assert p.remote_block_size == 64
    # A producer that does not send it (older than pull with kernel blocks): None, and the engine
    # takes the ids as P's engine blocks (its grant refuses them, naming the field, if they are not).
    t, p = tr.consumer_transfer(d_params(), "pull")
    assert p.remote_block_size is None
    t, p = tr.consumer_transfer(d_params(remote_block_size=64), "push")
    assert p.remote_block_size is None


@pytest.mark.parametrize(
    ("over", "mode", "reason"),
    [
        ({"transfer_id": _DROP}, "push", "neither transfer_id nor remote_request_id"),
        ({"transfer_id": ""}, "push", "transfer_id is empty"),
        ({"transfer_id": {"a": 1}}, "push", "transfer_id is dict"),
        ({"transfer_id": True}, "push", "transfer_id is bool"),
        ({"attempt": "x"}, "push", "attempt is 'x'"),
        ({"attempt": 0}, "push", "attempt is 0, outside"),
        ({"attempt": 2**32}, "push", "outside"),
        ({"remote_engine_id": None}, "push", "remote_engine_id is missing"),
        ({"remote_host": _DROP}, "push", "remote_host is missing"),
        ({"remote_port": "abc"}, "push", "remote_port is 'abc'"),
        ({"remote_port": 70000}, "push", "remote_port is 70000, outside"),
        ({"remote_port": 5600.5}, "push", "not an integer"),
        ({"tp_size": 0}, "push", "tp_size is 0"),
        ({"tp_size": [1]}, "push", "tp_size is [1]"),
        ({"remote_block_ids": None}, "pull", "remote_block_ids is None"),
        ({"remote_block_ids": [[]]}, "pull", "holds no block"),
        ({"remote_block_ids": [[1, -2]]}, "pull", "not a list of block ids"),
        ({"remote_block_ids": "1,2"}, "pull", "not a non-empty list"),
        ({"remote_block_size": 0}, "pull", "remote_block_size is 0, outside"),
        ({"remote_block_size": "big"}, "pull", "remote_block_size is 'big', not an integer"),
    ],
)
def test_consumer_refuses_with_the_reason(over: dict[str, Any], mode: str, reason: str) -> None:
    parsed = tr.consumer_transfer(d_params(**over), mode)
    assert isinstance(parsed, tr.Refused), parsed
    assert reason in parsed.reason, parsed.reason


def test_params_that_are_not_an_object_are_refused() -> None:
    for bad in ([1, 2], "transfer", 3):
        assert isinstance(tr.consumer_transfer(bad, "push"), tr.Refused)
        assert isinstance(tr.producer_transfer(bad, "r"), tr.Refused)
        assert not tr.is_consumer(bad) and not tr.is_producer(bad)


def test_producer_names_the_transfer_after_the_request_without_an_id() -> None:
    # vLLM's toy proxy: do_remote_decode and nulls.
    t = tr.producer_transfer({"do_remote_decode": True, "remote_engine_id": None, "remote_host": None}, "cmpl-9-0")
    assert (t.transfer_id, t.key, t.attempt) == ("cmpl-9-0", tr.transfer_key("cmpl-9-0"), 1)
    u = str(uuid.uuid4())
    t = tr.producer_transfer({"do_remote_decode": True, "transfer_id": u, "attempt": "2"}, "cmpl-9-0")
    assert (t.transfer_id, t.key, t.attempt) == (u, tr.transfer_key(u), 2)


def test_producer_reads_the_consumer_engine_the_router_chose() -> None:
    params = {"do_remote_decode": True, "transfer_id": HEX}
    assert tr.producer_transfer(params, "r").consumer_engine_id is None
    assert tr.producer_transfer({**params, "consumer_engine_id": None}, "r").consumer_engine_id is None
    t = tr.producer_transfer({**params, "consumer_engine_id": "decode-1"}, "r")
    assert (t.key, t.consumer_engine_id) == (HEX.lower(), "decode-1")
    bad = tr.producer_transfer({**params, "consumer_engine_id": "é" * 129}, "r")  # 258 bytes
    assert isinstance(bad, tr.Refused) and "258 bytes" in bad.reason


# ---- the scheduler half, with vLLM's objects stood in


def scheduler(mode: str = "push") -> Any:
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="engine-x"),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    cfg = kv.KVPushConfig(
        mode=mode, side_channel_host="10.0.0.9", side_channel_listen="0.0.0.0", side_channel_port=5700,
        nixl_backend="UCX", lease_ms=0, timeout_ms=0, peer_timeout_ms=0, writers=1, secret=None,
        insecure=True, device=None, staging="auto",
    )  # fmt: skip
    return kv._Scheduler(vllm_config, None, cfg)


def request(params: Any, rid: str = "req-1", tokens: int = 40, status: Any = RequestStatus.FINISHED_LENGTH_CAPPED):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(tokens)), kv_transfer_params=params, status=status)


class Blocks:
    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [list(g) for g in self.groups]


def run_d(params: Any, mode: str = "push") -> tuple[Any, tuple[int, bool]]:
    s = scheduler(mode)
    req = request(params)
    matched = s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([7, 8, 9, 10]), matched[0])
    return s, matched


def test_d_registers_a_uuid_transfer_under_p_s_key() -> None:
    u = str(uuid.uuid4())
    s, matched = run_d(d_params(transfer_id=u))
    assert matched == (40, True)
    [r] = s.meta.receives
    assert (r.transfer_id, r.attempt, r.producer, r.host, r.port) == (tr.transfer_key(u), 1, "prefill-0", "10.0.0.1", 5600)
    # 40 tokens in 3 blocks of 16: the exact count (a window counts back from it; the engine moves whole blocks)
    assert r.block_ids == [[7, 8, 9]] and r.num_tokens == 40


@pytest.mark.parametrize(
    "params",
    [
        d_params(transfer_id=_DROP),
        d_params(remote_port="abc"),
        d_params(attempt=-1),
        d_params(transfer_id=[]),
        d_params(remote_engine_id=_DROP, remote_host=_DROP, remote_port=_DROP),
        {"do_remote_prefill": True},
    ],
)
def test_d_prefills_locally_on_unusable_params(params: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    s, matched = run_d(params)
    assert matched == (0, False)  # vLLM computes the prompt itself
    assert not s.meta.receives and not s.receiving
    assert params["do_remote_prefill"] is False  # warned once: the next call sees a plain request
    assert s.get_num_new_matched_tokens(request(params), 0) == (0, False)
    # The request then finishes as a plain one: nothing to release, nothing staged.
    assert s.request_finished(request(params), ([7, 8, 9],)) == (False, None)
    assert not s.meta.aborts and not s.has_pending_push_work()


def test_d_pull_without_remote_blocks_prefills_locally() -> None:
    s, matched = run_d(d_params(remote_block_ids=_DROP), mode="pull")
    assert matched == (0, False) and not s.meta.receives


def test_p_without_an_id_names_the_transfer_after_the_request_and_tells_d() -> None:
    s = scheduler()
    toy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
           "remote_host": None, "remote_port": None}  # fmt: skip
    delay, out = s.request_finished(request(toy, rid="cmpl-p-0"), ([1, 2, 3, 4],))
    assert delay is True
    [f] = s.meta.finished
    assert (f.transfer_id, f.attempt, f.block_ids, f.num_tokens) == (tr.transfer_key("cmpl-p-0"), 1, [[1, 2, 3]], 40)
    assert out["transfer_id"] == "cmpl-p-0" and out["remote_request_id"] == "cmpl-p-0"
    # D, given P's answer as vLLM's proxies relay it, registers under the same key.
    d, _ = run_d(out)
    assert d.meta.receives[0].transfer_id == f.transfer_id
    assert (d.meta.receives[0].host, d.meta.receives[0].port) == ("10.0.0.9", 5700)


def test_p_hands_a_router_id_back_in_both_fields() -> None:
    # vLLM's push proxy relays remote_request_id, not transfer_id: D must still find the router's id.
    u = str(uuid.uuid4())
    _, out = scheduler().request_finished(request({"do_remote_decode": True, "transfer_id": u}), ([1, 2, 3],))
    relayed = {k: out[k] for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")}
    d, _ = run_d({"do_remote_prefill": True, **relayed})
    assert d.meta.receives[0].transfer_id == tr.transfer_key(u)


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_decode": True, "transfer_id": {"x": 1}},
        {"do_remote_decode": True, "transfer_id": ""},
        {"do_remote_decode": True, "transfer_id": HEX, "attempt": "first"},
        {"do_remote_decode": True, "transfer_id": HEX, "attempt": -3},
        {"do_remote_decode": True, "transfer_id": HEX, "consumer_engine_id": ""},
        {"do_remote_decode": True, "transfer_id": HEX, "consumer_engine_id": 7},
        {"do_remote_decode": True, "transfer_id": HEX, "consumer_engine_id": ["decode-0"]},
        {"do_remote_decode": True, "transfer_id": HEX, "consumer_engine_id": "d" * 257},
        {"do_remote_decode": True, "transfer_id": HEX, "consumer_engine_id": "\udc80"},
    ],
)
def test_p_releases_at_once_on_unusable_params(params: dict[str, Any]) -> None:
    s = scheduler()
    for status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED):
        assert s.request_finished(request(params, status=status), ([1, 2, 3],)) == (False, None)
    assert not s.meta.finished and not s.meta.aborts and not s.sending and not s.has_pending_push_work()


def test_p_hands_the_named_consumer_to_its_worker() -> None:
    s = scheduler()
    params = {"do_remote_decode": True, "transfer_id": HEX, "consumer_engine_id": "decode-1"}
    delay, _ = s.request_finished(request(params), ([1, 2, 3],))
    assert delay is True
    [f] = s.meta.finished
    assert (f.transfer_id, f.consumer) == (HEX.lower(), "decode-1")
    s2 = scheduler()
    s2.request_finished(request({"do_remote_decode": True, "transfer_id": HEX}), ([1, 2, 3],))
    assert s2.meta.finished[0].consumer is None


def test_p_abort_of_a_string_id_is_staged_under_its_key() -> None:
    s = scheduler()
    params = {"do_remote_decode": True, "transfer_id": "my-router-42", "attempt": 3}
    assert s.request_finished(request(params, status=RequestStatus.FINISHED_ABORTED), ([1],)) == (False, None)
    [a] = s.meta.aborts
    assert (a.transfer_id, a.attempt) == (tr.transfer_key("my-router-42"), 3)


def test_d_continuation_loads_only_p_s_prompt_tokens() -> None:
    # The router's continuation (issue #18): D's prompt is P's 40 tokens and the token P sampled; D
    # loads P's 40 and computes only position 40.
    p = scheduler("pull")
    _, out = p.request_finished(request({"do_remote_decode": True, "transfer_id": HEX}), ([1, 2, 3],))
    assert (out["remote_num_tokens"], out["remote_prompt_digest"]) == (40, tr.prompt_digest(range(40)))
    for tokens in (41, 40):  # the continuation, and a plain pull request (unchanged)
        d = scheduler("pull")
        req = request(dict(out), tokens=tokens)
        assert d.get_num_new_matched_tokens(req, 0) == (40, True)
        d.update_state_after_alloc(req, Blocks([7, 8, 9, 10]), 40)
        [r] = d.meta.receives
        assert (r.num_tokens, r.block_ids) == (40, [[7, 8, 9]])
    # With 16 of them in D's prefix cache, the other 24 come from P.
    assert scheduler("pull").get_num_new_matched_tokens(request(dict(out), tokens=41), 16) == (24, True)


@pytest.mark.parametrize("tokens, first", [(41, 1), (39, 0)])
def test_d_refuses_p_s_kv_for_a_prompt_that_does_not_begin_with_p_s(
    tokens: int, first: int, caplog: pytest.LogCaptureFixture
) -> None:
    _, out = scheduler("pull").request_finished(request({"do_remote_decode": True, "transfer_id": HEX}), ([1, 2, 3],))
    d = scheduler("pull")
    params = dict(out)
    req = SimpleNamespace(request_id="req-2", prompt_token_ids=list(range(first, first + tokens)),
                          kv_transfer_params=params, status=RequestStatus.FINISHED_LENGTH_CAPPED)  # fmt: skip
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)  # D computes its prompt itself
    assert not d.meta.receives and params["do_remote_prefill"] is False
    # P is told to free the transfer's blocks now rather than at its lease's end.
    [note] = d.meta.dropped
    assert (note.transfer_id, note.producer) == (HEX.lower(), "engine-x")
    assert "refusing P's KV" in caplog.text
    assert d.get_num_new_matched_tokens(req, 0) == (0, False) and len(d.meta.dropped) == 1
