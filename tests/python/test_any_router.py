"""kvpush's connector behind routers other than kvpush router, and with broken ``kv_transfer_params``.

Real vLLM CPU servers, P and D, in push and in pull mode, driven the way vLLM's own toy proxies drive them
(``servers.vllm_proxy_complete``: P first with ``max_tokens`` 1, then D with P's answer; the push proxy
relays only P's coordinates and ``remote_request_id``):
  - without any transfer id (vLLM's proxies send none: P names the transfer after its request id);
  - with UUID transfer ids (``str(uuid4())``, dashes included: not kvpush router's 32 hex digits);
  - push only: UUID ids on both legs sent at once (D registers before P has answered: both sides map
    the id to the engine's key on their own);
each checked against D computing the same prompts alone (tokens exact, logprobs within
``servers.LOGPROB_TOLERANCE``), with D's ``vllm:prompt_tokens_by_source`` proving the transfer: at most
the last prompt token of a request computed on D, the rest ``external_kv_transfer``.
  - malformed ``kv_transfer_params`` straight to P: P answers (computing the prompt as any request),
    releases the blocks at once (no lease) and keeps serving;
  - malformed ``kv_transfer_params`` straight to D: D warns, prefills the prompt itself, answers the
    same tokens, and keeps serving P/D requests.
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import servers as srv
import tiny_model

LENGTHS = [30, 200, 517]
MAX_TOKENS = 8
PROMPTS = tiny_model.make_prompts(LENGTHS, seed=23)
UNUSABLE = "kv_transfer_params unusable"


class Pair:
    def __init__(self, mode: str, p: srv.VllmServer, d: srv.VllmServer, reference: list[srv.Completion]) -> None:
        self.mode, self.p, self.d, self.reference = mode, p, d, reference


@pytest.fixture(scope="module", params=["push", "pull"])
def pair(request: pytest.FixtureRequest, servers: Any) -> Any:
    mode = request.param
    p_port, d_port = srv.free_ports(2)
    env = {"KVPUSH_LOG": os.environ.get("KVPUSH_TEST_LOG", "info")}
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            servers.vllm, f"anyr-{mode}-P", side_channel_port=p_port, extra_env=env,
            kv_transfer_config=srv.kvpush_config("prefill", mode, f"anyr-{mode}-prefill", p_port),
        )  # fmt: skip
        d = pool.submit(
            servers.vllm, f"anyr-{mode}-D", side_channel_port=d_port, extra_env=env,
            kv_transfer_config=srv.kvpush_config("decode", mode, f"anyr-{mode}-decode", d_port),
        )  # fmt: skip
        p, d = p.result(), d.result()
    # The reference: D alone (no prefix caching, no kv_transfer_params) computing each prompt itself.
    reference = [srv.complete(d.url, prompt, MAX_TOKENS) for prompt in PROMPTS]
    yield Pair(mode, p, d, reference)
    for s in (d, p):
        servers.stop(s)


def by_source_delta(d: srv.VllmServer, before: dict[str, float]) -> dict[str, float]:
    after = d.prompt_tokens_by_source()
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def check_transferred(pair: Pair, send: Any, what: str) -> None:
    """Sends every prompt with ``send(i)``; asserts the single engine's output and that D got the prompt's
    KV from P (at most the last prompt token computed on D)."""
    before = pair.d.prompt_tokens_by_source()
    for i, (n, ref) in enumerate(zip(LENGTHS, pair.reference)):
        got = send(i)
        print(f"  {what}, {n:4d} tokens: {got.token_ids[:6]}..., logprobs within {srv.logprob_gap(got, ref):.1e}")
        srv.assert_same_output(got, ref, f"{pair.mode}, {what}, {n}-token prompt")
    srv.check_transfer_counted(pair.d, before, LENGTHS)
    for s in (pair.p, pair.d):
        assert srv.wait_idle(s, 30) == (0, 0), f"{s.name} still holds KV blocks or requests"


def test_vllm_proxy_without_transfer_ids(pair: Pair) -> None:
    push = pair.mode == "push"
    check_transferred(
        pair,
        lambda i: srv.vllm_proxy_complete(pair.p.url, pair.d.url, PROMPTS[i], MAX_TOKENS, push=push, stream=i == 1),
        "vLLM proxy, no transfer id",
    )


def test_vllm_proxy_with_uuid_transfer_ids(pair: Pair) -> None:
    push = pair.mode == "push"
    check_transferred(
        pair,
        lambda i: srv.vllm_proxy_complete(
            pair.p.url, pair.d.url, PROMPTS[i], MAX_TOKENS, push=push, transfer_id=str(uuid.uuid4())
        ),
        "vLLM proxy, UUID transfer ids",
    )


@pytest.mark.parametrize("pair", ["push"], indirect=True)
def test_uuid_transfer_ids_on_both_legs_at_once(pair: Pair) -> None:
    p = pair.p

    def send(i: int) -> srv.Completion:
        tid = str(uuid.uuid4())
        p_params = {"do_remote_decode": True, "transfer_id": tid}
        d_params = srv.consumer_params(p, tid)
        with ThreadPoolExecutor(2) as pool:
            d_fut = pool.submit(srv.complete, pair.d.url, PROMPTS[i], MAX_TOKENS, extra={"kv_transfer_params": d_params})
            p_fut = pool.submit(srv.complete, p.url, PROMPTS[i], 1, extra={"kv_transfer_params": p_params})
            p_fut.result()
            return d_fut.result()

    check_transferred(pair, send, "UUID ids, both legs at once")


BAD_FOR_P: list[dict[str, Any]] = [
    {"do_remote_decode": True, "transfer_id": {"nested": 1}},
    {"do_remote_decode": True, "transfer_id": ""},
    {"do_remote_decode": True, "attempt": "first"},
    {"do_remote_decode": True, "transfer_id": "abc", "attempt": -1},
]


@pytest.mark.parametrize("pair", ["push"], indirect=True)
def test_malformed_params_to_p_release_at_once(pair: Pair) -> None:
    p = pair.p
    log_before = p.log_path.read_text(errors="replace").count(UNUSABLE)
    for params in BAD_FOR_P:
        got = srv.complete(p.url, PROMPTS[1], 4, extra={"kv_transfer_params": params})
        assert got.token_ids == pair.reference[1].token_ids[:4], params
        # Released at once: no block held, although the lease (30 s by default) would hold them.
        usage = srv.wait_idle(p, 5)
        assert usage == (0, 0), f"P holds blocks after {params}: {usage}"
    warned = p.log_path.read_text(errors="replace").count(UNUSABLE) - log_before
    print(f"\n  P answered {len(BAD_FOR_P)} malformed requests, warned {warned} times, holds nothing")
    assert warned == len(BAD_FOR_P)
    assert p.alive()
    check_transferred(
        pair, lambda i: srv.vllm_proxy_complete(p.url, pair.d.url, PROMPTS[i], MAX_TOKENS, push=True), "after"
    )


def bad_for_d(p: srv.VllmServer) -> list[dict[str, Any]]:
    good = srv.consumer_params(p, str(uuid.uuid4()))
    return [
        {"do_remote_prefill": True},
        {**good, "remote_port": "abc"},
        {**good, "transfer_id": []},
        {**good, "transfer_id": None},  # and no remote_request_id: nothing names the transfer
        {**good, "tp_size": 0},
        {**good, "remote_host": None},
    ]


def test_malformed_params_to_d_prefill_locally(pair: Pair) -> None:
    d = pair.d
    bad = bad_for_d(pair.p)
    log_before = d.log_path.read_text(errors="replace").count(UNUSABLE)
    before = d.prompt_tokens_by_source()
    for params in bad:
        got = srv.complete(d.url, PROMPTS[0], MAX_TOKENS, extra={"kv_transfer_params": params})
        srv.assert_same_output(got, pair.reference[0], f"D given {params}")
    delta = by_source_delta(d, before)
    warned = d.log_path.read_text(errors="replace").count(UNUSABLE) - log_before
    print(f"\n  D answered {len(bad)} malformed requests itself ({delta}), warned {warned} times")
    assert warned == len(bad)
    # Every prompt token was computed on D; none came through the connector.
    assert delta.get("local_compute", 0) == len(bad) * LENGTHS[0], delta
    assert delta.get("external_kv_transfer", 0) == 0, delta
    assert d.alive()
    push = pair.mode == "push"
    check_transferred(
        pair, lambda i: srv.vllm_proxy_complete(pair.p.url, d.url, PROMPTS[i], MAX_TOKENS, push=push), "after"
    )
