"""The environment, proven with vLLM's OWN connectors before kvpush's is compared against it.

(a) One vLLM engine alone is deterministic under greedy decoding, and its output depends on the whole
    prompt (two prompts that differ only in their first token continue differently): the tiny model makes
    the KV matter, so a P/D setup that loses or garbles KV cannot reproduce it.
(b) vLLM's stock ``NixlConnector`` (pull: D reads P's blocks) with P and D as two servers behind
    ``kvpush router --mode pull`` reproduces the single engine's tokens exactly and its logprobs within
    ``servers.LOGPROB_TOLERANCE`` (float32 rounding: D computes the last prompt token alone), and D
    prefilled at most the one trailing prompt token per request itself.
(c) The same with vLLM's stock ``NixlPushConnector`` (push: P writes into blocks D registered) behind
    ``kvpush router --mode push`` (both legs sent at once with the same ``X-Request-Id``, by which stock
    vLLM pairs them). The router also gives D the ``remote_request_id`` stock push D requires (P's
    request id up to its engine's random suffix), so stock vLLM runs unmodified.

Five server starts in all (about a minute each); P and D of a pair start concurrently.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import requests

import servers as srv
import tiny_model

LENGTHS = [30, 200, 517, 900]
MAX_TOKENS = 16
PROMPTS = tiny_model.make_prompts(LENGTHS, seed=6)
# One request through vLLM's own connectors (servers already warm): it takes seconds when it works; when
# their side channel stalls on this 2-core machine it hangs, and waiting longer than this only costs time.
STOCK_TIMEOUT_S = 180.0


@dataclass
class SingleEngine:
    first: list[srv.Completion]
    second: list[srv.Completion]
    as_text: srv.Completion
    variant: srv.Completion  # PROMPTS[1] with another first token
    version: str


@pytest.fixture(scope="module")
def single(servers: "object", vllm_ready: str) -> SingleEngine:
    """Runs one engine alone (no connector, no prefix caching), records its outputs, stops it."""
    s = servers.vllm("single", prefix_caching=False)
    try:
        first = [srv.complete(s.url, p, MAX_TOKENS) for p in PROMPTS]
        second = [srv.complete(s.url, p, MAX_TOKENS) for p in PROMPTS]
        as_text = srv.complete(s.url, tiny_model.ids_to_text(PROMPTS[1]), MAX_TOKENS)
        other_first = PROMPTS[1][0] + 1 if PROMPTS[1][0] + 1 < 1024 else 4
        variant = srv.complete(s.url, [other_first] + PROMPTS[1][1:], MAX_TOKENS)
    finally:
        servers.stop(s)
    return SingleEngine(first, second, as_text, variant, vllm_ready)


def test_single_engine_is_deterministic_and_context_matters(single: SingleEngine) -> None:
    print(f"\nvLLM {single.version}, tiny Llama {tiny_model.model_dir()}")
    for n, a, b in zip(LENGTHS, single.first, single.second):
        print(f"  {n:4d} prompt tokens -> {a.token_ids[:8]}... logprobs {[round(x, 4) for x in a.logprobs[:4]]}...")
        assert len(a.token_ids) == MAX_TOKENS
        assert a.token_ids == b.token_ids, f"{n}-token prompt: greedy output changed between two runs"
        assert a.logprobs == b.logprobs, f"{n}-token prompt: logprobs changed between two runs"
    outputs = {tuple(c.token_ids) for c in single.first}
    assert len(outputs) == len(PROMPTS), "different prompts gave the same continuation"
    assert single.as_text.token_ids == single.first[1].token_ids, "text prompt != the same token ids"
    # Only the first of 200 tokens differs: the continuation must still change (distant KV matters).
    print(f"  first token changed: {single.variant.token_ids[:8]}... vs {single.first[1].token_ids[:8]}...")
    assert single.variant.token_ids != single.first[1].token_ids
    # The output distribution is far from uniform (dummy weights give log(1/1024) = -6.93 everywhere).
    assert max(max(c.logprobs) for c in single.first) > -3.0


def _start_pair(
    servers: "object", connector: str, tag: str, d_env: dict[str, str] | None = None
) -> tuple[srv.VllmServer, srv.VllmServer]:
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            servers.vllm, f"{tag}-P", kv_transfer_config=srv.nixl_kv_config("prefill", connector, f"{tag}-prefill")
        )
        d = pool.submit(
            servers.vllm,
            f"{tag}-D",
            kv_transfer_config=srv.nixl_kv_config("decode", connector, f"{tag}-decode"),
            extra_env=d_env,
        )
        return p.result(), d.result()


def _check_pd(
    servers: "object",
    single: SingleEngine,
    connector: str,
    mode: str,
    d_env: dict[str, str] | None = None,
    retry: bool = False,
) -> None:
    p, d = _start_pair(servers, connector, mode, d_env)
    router = servers.router(mode, [p], [d], name=f"router-{mode}")
    try:
        before = d.prompt_tokens_by_source()
        print(f"\n{connector} behind kvpush router --mode {mode}: P {p.url}, D {d.url}, router {router.url}")
        for i, (n, ref) in enumerate(zip(LENGTHS, single.first)):
            try:
                got = srv.complete(router.url, PROMPTS[i], MAX_TOKENS, stream=(i % 2 == 1), timeout_s=STOCK_TIMEOUT_S)
            except srv.ServerError as e:
                if not retry:
                    raise
                # Stock vLLM gives its side-channel handshake 5 s (hard-coded); on a loaded 2-core machine,
                # beside two progress threads that each spin a core, it can miss that. Once, not twice.
                print(f"  {n:4d} tokens: failed once ({str(e)[:160]}); retrying")
                got = srv.complete(router.url, PROMPTS[i], MAX_TOKENS, stream=(i % 2 == 1), timeout_s=STOCK_TIMEOUT_S)
            worst = srv.logprob_gap(got, ref)
            print(
                f"  {n:4d} tokens: tokens {'equal' if got.token_ids == ref.token_ids else 'DIFFER'}, "
                f"logprobs within {worst:.1e}"
                f"{' (streamed, TTFT %.3f s)' % got.ttft_s if got.ttft_s else ''}"
            )
            srv.assert_same_output(got, ref, f"{mode}: {n}-token prompt")
        after = d.prompt_tokens_by_source()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        print(f"  D's prompt tokens by source over these requests: {delta}")
        # D recomputes at most the last prompt token of each request; the rest came through NIXL.
        assert delta.get("local_compute", 0) <= len(PROMPTS)
        assert delta.get("external_kv_transfer", 0) >= sum(LENGTHS) - len(PROMPTS)
    finally:
        for s in (router, d, p):
            servers.stop(s)


# vLLM 0.32's own connectors are flaky on this shared 2-core machine, and they are not ours: these two
# tests prove the environment, and kvpush's own pull and push tests do not depend on them. They are not
# strict xfails, because they pass in most runs (a strict xfail would then fail CI), nor blanket
# non-strict xfails, which hid every failure, wrong tokens included. Only the two known ways stock vLLM
# stalls (the router answering with an error: ServerError; no answer within STOCK_TIMEOUT_S:
# requests.Timeout, or requests.ConnectionError wrapping urllib3's ReadTimeoutError when the stall
# comes mid-stream) mark the test xfailed; anything else, an output that differs included, fails it.
_STOCK_FLAKES = (srv.ServerError, requests.Timeout, requests.ConnectionError)


def test_stock_nixl_pull_behind_router_matches_single_engine(servers: "object", single: SingleEngine) -> None:
    try:
        _check_pd(servers, single, "NixlConnector", "pull", retry=True)
    except _STOCK_FLAKES as e:
        # In the CI-like run of 2026-11-30 17:54 UTC its P (NIXL progress thread spinning a core, beside
        # D's) missed a 2 s health probe and one transfer stayed 'in progress' for 20 s.
        pytest.xfail(f"stock NixlConnector stalled on this machine ({type(e).__name__}): {str(e)[:500]}")


def test_stock_nixl_push_behind_router_matches_single_engine(servers: "object", single: SingleEngine) -> None:
    # Unmodified: the router's push request to D carries the remote_request_id stock push D requires.
    try:
        _check_pd(servers, single, "NixlPushConnector", "push", None, retry=True)
    except _STOCK_FLAKES as e:
        # Its side-channel handshake timeout is a hard-coded 5 s; in the CI run of 2026-11-30 16:00 UTC
        # D's leg did not answer in 600 s.
        pytest.xfail(f"stock NixlPushConnector stalled on this machine ({type(e).__name__}): {str(e)[:500]}")
