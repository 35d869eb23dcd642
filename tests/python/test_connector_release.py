"""P's scheduler half, without servers: a prefill that ends with its step goes to the engine at once.

The router's prefill leg asks for one token, so when a step computes a request's whole prompt the
request ends with that step. The scheduler then puts its blocks in that step's metadata (the worker hands
them to the engine right after the forward pass) instead of waiting for vLLM's ``request_finished``;
until that call comes, vLLM must not preempt the request (``has_pending_block_frees``), and the call
keeps the blocks held and does not hand them over a second time.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

kv = pytest.importorskip("kvpush.vllm", reason="the kvpush package (maturin develop) and vLLM")
from vllm.v1.request import RequestStatus  # noqa: E402

import connector_kit as kit  # noqa: E402

TID = "0123456789abcdef0123456789abcdef"
BLOCK = 16


def scheduler(**config: Any) -> "kv._Scheduler":
    """A scheduler half (P's or D's: the role comes from each request's params); ``config`` overrides
    ``KVPushConfig`` fields."""
    return kv._Scheduler(kit.vllm_config("prefill-0", BLOCK), None, kit.config(**config))


def request(rid: str, prompt: int, status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": TID},
        prompt_token_ids=list(range(prompt)),
        status=status,
    )


def step(req: SimpleNamespace, scheduled: int, max_tokens: int = 1, blocks: int = 8) -> SimpleNamespace:
    new = SimpleNamespace(
        req_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=SimpleNamespace(max_tokens=max_tokens),
        block_ids=(list(range(100, 100 + blocks)),),
        num_computed_tokens=0,
    )
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={req.request_id: scheduled},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )


def test_whole_prompt_of_a_one_token_request_is_released_with_its_step() -> None:
    s = scheduler()
    req = request("r1", 100)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = s.build_connector_meta(step(req, 100))
    assert meta.finished == []
    assert [(f.req_id, f.transfer_id, f.block_ids, f.num_tokens) for f in meta.prefilled] == [
        ("r1", TID, [list(range(100, 107))], 100)  # 100 tokens (exact) in 7 blocks of 16
    ]
    # Until vLLM finishes it, it must not be preempted, and the engine loop keeps stepping.
    assert s.has_pending_block_frees() and s.has_pending_push_work()
    held, params = s.request_finished(req, (list(range(100, 108)),))
    assert held and params is not None
    assert params["transfer_id"] == TID and params["remote_block_ids"] == [list(range(100, 107))]
    # The block size the ids count in: D's engine finds P's kernel blocks from it (pull).
    assert params["remote_block_size"] == 16
    assert not s.has_pending_block_frees()
    later = s.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}))
    assert later.finished == [] and later.prefilled == []  # handed over once
    assert s.has_pending_push_work()  # the blocks stay held until the engine reports them sent
    s.update_connector_output(SimpleNamespace(finished_sending={"r1"}, finished_recving=None))
    assert not s.has_pending_push_work()


def test_an_early_released_request_aborted_keeps_its_blocks_and_tells_the_engine() -> None:
    s = scheduler()
    req = request("r2", 40, RequestStatus.FINISHED_ABORTED)
    s.get_num_new_matched_tokens(req, 0)
    assert len(s.build_connector_meta(step(req, 40)).prefilled) == 1
    held, params = s.request_finished(req, (list(range(100, 108)),))
    assert held and params is None  # the engine may be reading them: freed when it reports
    assert [(a.req_id, a.transfer_id) for a in s.meta.aborts] == [("r2", TID)]
    assert not s.has_pending_block_frees()


@pytest.mark.parametrize(("scheduled", "max_tokens"), [(64, 1), (100, 2)])
def test_other_requests_go_through_request_finished(scheduled: int, max_tokens: int) -> None:
    # A prompt only partly computed in this step (chunked prefill), or a request that goes on decoding,
    # is not finished by this step: its blocks go to the engine when vLLM finishes it, as before.
    s = scheduler()
    req = request("r3", 100)
    s.get_num_new_matched_tokens(req, 0)
    assert s.build_connector_meta(step(req, scheduled, max_tokens)).prefilled == []
    assert not s.has_pending_block_frees()
    held, params = s.request_finished(req, (list(range(100, 108)),))
    assert held and params is not None
    assert [(f.req_id, f.block_ids) for f in s.meta.finished] == [("r3", [list(range(100, 107))])]
