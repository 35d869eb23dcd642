"""Requests that end at each stage of vLLM's scheduler, without servers (issue 17, item 7).

The scheduler half sees a request's life through vLLM's calls; these tests drive it as vLLM's
scheduler does (fake requests, block lists and scheduler outputs) and check that every path frees
everything: P's held blocks, D's registrations, and — the case that used to leak until P's lease —
a request D drops while it still waits in vLLM's queue for blocks, which never registered anything:
P is told at once (``dropped``); and one that waits there longer than a third of P's lease, which P
restarts when told (``holds``). tests/engine/lifecycle.rs checks what P does with both.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

kv = pytest.importorskip("kvpush.vllm", reason="the kvpush package (maturin develop) and vLLM")
import kvpush._transfer as tr  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from test_connector_release import scheduler  # noqa: E402  (P's and D's scheduler half alike)

HEX = "00112233445566778899aabbccddeeff"
BLOCK = 16


def d_request(rid: str = "d-1", status: Any = RequestStatus.FINISHED_ABORTED, **over: Any) -> SimpleNamespace:
    params = {
        "do_remote_prefill": True,
        "transfer_id": HEX,
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 2,
    }
    params.update(over)
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(40)), kv_transfer_params=params, status=status)


class Blocks:
    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [list(g) for g in self.groups]


def no_step() -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})


def test_d_request_aborted_while_queued_tells_p() -> None:
    s = scheduler()
    req = d_request()
    # vLLM asks how many tokens come from outside, then finds no room and leaves it waiting...
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    # ...until the client goes away: vLLM finishes it with no blocks.
    assert s.request_finished(req, ([],)) == (False, None)
    assert s.has_pending_push_work()  # the next step carries the news to the workers
    meta = s.build_connector_meta(no_step())
    [d] = meta.dropped
    assert (d.req_id, d.transfer_id, d.attempt) == ("d-1", HEX, 1)
    assert (d.producer, d.host, d.port, d.producer_tp) == ("prefill-0", "10.0.0.1", 5600, 2)
    assert not meta.receives and not meta.aborts
    assert not s.has_pending_push_work() and not s.receiving
    # Told once: vLLM calling again (it does not, but a re-entry must not repeat it) adds nothing.
    assert s.request_finished(req, ([],)) == (False, None)
    assert s.build_connector_meta(no_step()).dropped == []


def test_d_request_aborted_before_it_was_ever_scheduled_tells_p() -> None:
    s = scheduler()
    req = d_request(transfer_id="3f2b6c1e-0d1c-4b8e-9a55-7d2c0c6f1e42")
    assert s.request_finished(req, ([],)) == (False, None)
    [d] = s.build_connector_meta(no_step()).dropped
    assert d.transfer_id == tr.transfer_key("3f2b6c1e-0d1c-4b8e-9a55-7d2c0c6f1e42")


def test_d_request_with_unusable_params_dropped_tells_nobody() -> None:
    s = scheduler()
    req = d_request(remote_port="nope")
    assert s.request_finished(req, ([],)) == (False, None)
    assert s.build_connector_meta(no_step()).dropped == []


def test_d_request_queued_for_blocks_keeps_p_holding_until_allocated() -> None:
    s = scheduler()
    assert s.hold_every == 10.0  # a third of the engine's 30 s lease when lease_ms is 0
    s.hold_every = 0.05
    req = d_request(status=None)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    assert s.build_connector_meta(no_step()).holds == []  # not due yet
    time.sleep(0.06)
    s.get_num_new_matched_tokens(req, 0)  # vLLM asks again each step it cannot place it
    [h] = s.build_connector_meta(no_step()).holds
    assert (h.req_id, h.transfer_id, h.producer, h.host, h.port, h.producer_tp) == (
        "d-1", HEX, "prefill-0", "10.0.0.1", 5600, 2
    )
    assert s.build_connector_meta(no_step()).holds == []  # once per interval
    # Allocated: it registers, and P's lease no longer matters (the registration is what P waits for).
    s.update_state_after_alloc(req, Blocks([7, 8, 9]), 40)
    time.sleep(0.06)
    meta = s.build_connector_meta(no_step())
    assert meta.holds == [] and [r.req_id for r in meta.receives] == ["d-1"]


def test_hold_interval_is_a_third_of_the_configured_lease() -> None:
    assert scheduler(lease_ms=9000).hold_every == 3.0


def test_d_request_aborted_while_its_kv_arrives_is_aborted_not_dropped() -> None:
    s = scheduler()
    req = d_request()
    count, _ = s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([7, 8, 9]), count)
    registered = s.build_connector_meta(no_step())
    assert [r.req_id for r in registered.receives] == ["d-1"]
    # Aborted while WAITING_FOR_REMOTE_KVS: its blocks stay vLLM's to free once the workers report the
    # transfer over (peers may still write into them).
    assert s.request_finished(req, ([7, 8, 9],)) == (True, None)
    meta = s.build_connector_meta(no_step())
    assert [(a.req_id, a.transfer_id) for a in meta.aborts] == [("d-1", HEX)] and meta.dropped == []
    assert s.has_pending_push_work()
    s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"d-1"}))
    assert not s.has_pending_push_work() and not s.receiving


def test_d_request_finished_after_its_kv_arrived_tells_nobody() -> None:
    s = scheduler()
    req = d_request(status=RequestStatus.FINISHED_STOPPED)
    count, _ = s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([7, 8, 9]), count)
    s.build_connector_meta(no_step())
    s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"d-1"}))
    assert s.request_finished(req, ([7, 8, 9],)) == (False, None)
    meta = s.build_connector_meta(no_step())
    assert (meta.aborts, meta.dropped, meta.receives) == ([], [], [])
    assert not s.has_pending_push_work()


@pytest.mark.parametrize("reported", [False, True], ids=["quarantined", "failed"])
def test_vllms_rejection_stand_in_for_a_registered_request_is_not_a_drop(reported: bool) -> None:
    # A registered request ends in error while its KV is awaited (the "fail" policy after a failed or
    # quarantined load). vLLM's serving layer answers HTTP 500 and, taking the error for a request that
    # never reached the engine, submits a pre-aborted stand-in under the body's request id, with a prompt
    # of one token and a copy of the request's kv_transfer_params (do_remote_prefill still set):
    # AsyncLLM.notify_kv_transfer_request_rejected. The transfer is the request's, already ended by its
    # own outcome: the stand-in is not a drop (it was counted as one, requests_dropped=1, in
    # tests/python/test_quarantine_vllm.py).
    s = scheduler()
    req = d_request("cmpl-d-1-0-1a2b3c4d", status=RequestStatus.FINISHED_ERROR)
    count, _ = s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks([7, 8, 9]), count)
    assert [r.req_id for r in s.build_connector_meta(no_step()).receives] == ["cmpl-d-1-0-1a2b3c4d"]
    if reported:  # failed: the workers reported it, its blocks went back
        s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"cmpl-d-1-0-1a2b3c4d"}))
        assert s.request_finished(req, ([7, 8, 9],)) == (False, None)
    else:  # quarantined: still awaited, its blocks held
        assert s.request_finished(req, ([7, 8, 9],)) == (True, None)
    s.build_connector_meta(no_step())
    stand_in = d_request("d-1")
    stand_in.prompt_token_ids = [0]
    assert s.request_finished(stand_in, ([],)) == (False, None)
    assert s.build_connector_meta(no_step()).dropped == []
    # Another attempt of the transfer, never registered here, is still a drop.
    other = d_request("d-2", attempt=2)
    assert s.request_finished(other, ([],)) == (False, None)
    assert [(d.req_id, d.attempt) for d in s.build_connector_meta(no_step()).dropped] == [("d-2", 2)]


def p_request(rid: str, status: Any) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": HEX},
        prompt_token_ids=list(range(40)),
        status=status,
    )


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_p_request_ended_before_its_prefill_completed_frees_at_once(status: Any) -> None:
    s = scheduler()
    req = p_request("p-1", status)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    # Scheduled for part of its prompt (chunked prefill), then preempted and resumed: never handed over.
    new = SimpleNamespace(
        req_id="p-1", prompt_token_ids=req.prompt_token_ids, sampling_params=SimpleNamespace(max_tokens=1),
        block_ids=([1, 2],), num_computed_tokens=0,
    )  # fmt: skip
    step = SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={"p-1": 20})
    assert s.build_connector_meta(step).prefilled == []
    # vLLM frees its blocks now; the engine (and so a D that registered) hears of the abort.
    assert s.request_finished(req, ([1, 2],)) == (False, None)
    meta = s.build_connector_meta(no_step())
    assert [(a.req_id, a.transfer_id) for a in meta.aborts] == [("p-1", HEX)] and meta.finished == []
    assert not s.sending and not s.producing and not s.has_pending_block_frees()


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def tell_producer(self, *args: Any) -> None:
        self.calls.append(args)

    def abort(self, *args: Any) -> None:
        self.calls.append(("abort", *args))


def test_worker_tells_the_producer_of_a_dropped_request() -> None:
    import connector_kit as kit

    w = kit.worker(_Recorder(), blocks_per_block=1, kernel_tokens=BLOCK)
    meta = kv.KVPushMetadata(
        dropped=[kv.ToProducer("d-1", HEX, 1, "prefill-0", "10.0.0.1", 5600, 2)],
        holds=[kv.ToProducer("d-2", "f" * 32, 3, "prefill-1", "10.0.0.2", 5700, 1)],
    )
    w.start_load_kv(meta)
    assert w.native.calls == [
        ("drop", HEX, 1, "prefill-0", "10.0.0.1", 5600, 2),
        ("hold", "f" * 32, 3, "prefill-1", "10.0.0.2", 5700, 1),
    ]
    assert w.stats.counts() == {"requests_dropped": 1}
    # Nothing is owed to vLLM for it: no finished set names it.
    assert w.outcomes.take(HEX, 1) is None
