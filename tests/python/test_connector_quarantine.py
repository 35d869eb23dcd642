"""Quarantined blocks stay vLLM's to hold until the engine releases them (issue 16), without servers.

The engine ends a request whose blocks a lost or silent peer may still write into with "quarantined"
(the end, in time) and, later, "released" (the blocks may be reused). The connector's worker half,
driven here over a fake native worker, must report the end at once but give the blocks back only
with "released":

- D: the request's blocks are reported as load errors at once (vLLM's ``fail`` policy ends it with an
  error; ``recompute`` marks it for recomputation), and the request stays out of ``finished_recving``,
  which is what keeps vLLM's scheduler from freeing its blocks (``Scheduler.finish_requests`` delays
  the free of a request whose transfer has not finished; a failed load is recomputed only once
  it has);
- P: the request stays out of ``finished_sending`` (vLLM frees a producer's blocks when it appears
  there) until "released";
- every other outcome keeps its meaning, and a late outcome of a quarantined attempt ends nothing.

Then D's scheduler half: a request kept waiting stays in its ``receiving`` set, so vLLM keeps
stepping the engine (``has_pending_push_work``) until the release reaches it.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

kv = pytest.importorskip("kvpush.vllm", reason="the kvpush package (maturin develop) and vLLM")
import connector_kit as kit  # noqa: E402

TID = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"


class FakeNative:
    """Records what the worker half hands the engine; ``poll`` returns what a test queued."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, str, int, str, list[list[int]]]] = []
        self.calls: list[tuple[Any, ...]] = []

    def blocks_allocated(self, *args: Any) -> None:
        self.calls.append(("blocks_allocated", *args))

    def request_finished(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("request_finished", *args))

    def abort(self, *args: Any) -> None:
        self.calls.append(("abort", *args))

    def poll(self) -> list[tuple[str, str, int, str, list[list[int]]]]:
        out, self.outcomes = self.outcomes, []
        return out


def worker() -> tuple["kv._Worker", FakeNative]:
    w = kv._Worker(kit.vllm_config("engine-0"), None, kit.config())
    native = FakeNative()
    w.native = native
    return w, native


def receive(rid: str, tid: str, blocks: list[int]) -> "kv.Receive":
    return kv.Receive(
        req_id=rid, transfer_id=tid, attempt=1, producer="prefill-0", host="127.0.0.1", port=5600,
        producer_tp=1, block_ids=[blocks], num_tokens=16 * len(blocks),
    )  # fmt: skip


def finished(rid: str, tid: str, blocks: list[int]) -> "kv.Finished":
    return kv.Finished(req_id=rid, transfer_id=tid, attempt=1, block_ids=[blocks], num_tokens=16 * len(blocks))


def test_a_quarantined_load_fails_at_once_but_its_blocks_come_back_only_when_released() -> None:
    w, native = worker()
    w.start_load_kv(kv.KVPushMetadata(receives=[receive("d1", TID, [4, 5, 6]), receive("d2", OTHER, [7])]))
    assert [c[0] for c in native.calls] == ["blocks_allocated", "blocks_allocated"]
    native.outcomes = [
        ("quarantined", TID, 1, "producer lost; its data path could not be fenced", [[4, 5, 6]]),
        ("received", OTHER, 1, "", []),
    ]
    sending, recving = w.get_finished()
    # The end is reported in time (its blocks are load errors: vLLM fails or recomputes it) ...
    assert w.get_block_ids_with_load_errors() == {4, 5, 6}
    # ... but the request does not finish its transfer: vLLM keeps its blocks.
    assert (sending, recving) == (set(), {"d2"})
    assert w.outcomes.quarantined == 1
    # Steps go by; nothing more about it, nothing given back.
    for _ in range(3):
        assert w.get_finished() == (set(), set())
        assert w.get_block_ids_with_load_errors() == set()
    # A late outcome of the quarantined attempt (an abort's "ended") ends nothing.
    native.outcomes = [("ended", TID, 1, "", [])]
    assert w.get_finished() == (set(), set())
    # The engine releases the blocks: now vLLM may free them.
    native.outcomes = [("released", TID, 1, "", [])]
    assert w.get_finished() == (set(), {"d1"})
    assert w.get_block_ids_with_load_errors() == set()  # reported once, at the quarantine
    assert w.outcomes.quarantined == 0
    data = w.take_stats().data
    assert (data["requests_quarantined"], data["requests_released"], data["requests_failed"]) == (1, 1, 1)
    # A second "released" (the engine sends exactly one) gives nothing back twice.
    native.outcomes = [("released", TID, 1, "", [])]
    assert w.get_finished() == (set(), set())


def test_a_hybrid_models_quarantined_load_fails_only_with_its_release() -> None:
    # Several KV cache groups: vLLM takes no block-level load errors, only failed requests
    # (failed_recving, which also finishes the request and frees its blocks).
    w, native = worker()
    w.multi_group = True
    w.start_load_kv(kv.KVPushMetadata(receives=[receive("d1", TID, [4, 5, 6])]))
    native.outcomes = [("quarantined", TID, 1, "producer lost; its data path could not be fenced", [[4, 5, 6]])]
    assert w.get_finished() == (set(), set())
    # Held: no block errors (vLLM refuses them here), no failed request (it would free the blocks).
    assert (w.get_block_ids_with_load_errors(), w.take_failed()) == (set(), set())
    native.outcomes = [("released", TID, 1, "", [])]
    assert w.get_finished() == (set(), {"d1"})
    # Released: the request ends as a failed load now, so vLLM's failure policy applies to it.
    assert w.take_failed() == {"d1"}


def test_a_producer_whose_sources_are_quarantined_holds_them_until_released() -> None:
    w, native = worker()
    w.wait_for_save(kv.KVPushMetadata(prefilled=[finished("p1", TID, [1, 2])]))
    w.start_load_kv(kv.KVPushMetadata(finished=[finished("p2", OTHER, [3])]))
    assert [c[0] for c in native.calls] == ["request_finished", "request_finished"]
    native.outcomes = [("quarantined", TID, 1, "consumer lost", [[1, 2]]), ("sent", OTHER, 1, "Sent", [])]
    assert w.get_finished() == ({"p2"}, set())
    # P's sources are not load errors of anything: nothing is reported for them.
    assert w.get_block_ids_with_load_errors() == set()
    assert w.get_finished() == (set(), set())
    native.outcomes = [("released", TID, 1, "", [])]
    assert w.get_finished() == ({"p1"}, set())


def test_a_retry_is_not_held_by_its_older_attempts_quarantine() -> None:
    w, native = worker()
    w.start_load_kv(kv.KVPushMetadata(receives=[receive("old", TID, [4])]))
    native.outcomes = [("quarantined", TID, 1, "producer lost", [[4]])]
    assert w.get_finished() == (set(), set())
    retry = dataclasses.replace(receive("new", TID, [9]), attempt=2)
    w.start_load_kv(kv.KVPushMetadata(receives=[retry]))
    native.outcomes = [("received", TID, 2, "", [])]
    assert w.get_finished() == (set(), {"new"})
    native.outcomes = [("released", TID, 2, "", []), ("released", TID, 1, "", [])]
    assert w.get_finished() == (set(), {"old"})


def test_d_keeps_stepping_while_a_quarantined_request_waits_for_its_release() -> None:
    s = kv._Scheduler(kit.vllm_config("decode-0"), None, kit.config())
    req = SimpleNamespace(
        request_id="d1",
        kv_transfer_params={
            "do_remote_prefill": True, "transfer_id": TID, "remote_engine_id": "prefill-0",
            "remote_host": "127.0.0.1", "remote_port": 5600,
        },
        prompt_token_ids=list(range(40)),
    )  # fmt: skip
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    s.update_state_after_alloc(req, SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: ([4, 5, 6],)), 40)
    meta = s.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}))
    assert [r.block_ids for r in meta.receives] == [[[4, 5, 6]]]
    # The worker reported the quarantine (load errors only): the request is still receiving.
    s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving=None))
    assert s.has_pending_push_work()
    # vLLM's fail policy ends the request meanwhile: its blocks stay held, the engine is told.
    from vllm.v1.request import RequestStatus

    req.status = RequestStatus.FINISHED_ERROR
    held, _ = s.request_finished(req, ([4, 5, 6],))
    assert held and [a.req_id for a in s.meta.aborts] == ["d1"]
    assert s.has_pending_push_work()
    s.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}))
    assert s.has_pending_push_work()
    s.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"d1"}))
    assert not s.has_pending_push_work()
