"""kvpush's vLLM connector in real vLLM: P and D as two servers behind ``kvpush router``.

Checked against one vLLM engine alone (same tiny seeded model in float32, greedy, logprobs). "Equal" is
``servers.assert_same_output``: the same tokens, and logprobs within ``servers.LOGPROB_TOLERANCE`` (1e-4;
D computes the last prompt token alone and concurrent requests decode in batches, which float32 rounds
differently by a few 1e-6):
  - push: 20 prompts of 30 to 900 tokens, tokens and logprobs equal; D computed none of the prompt
    itself (vLLM's prompt-tokens-by-source: at most the one trailing token per request);
  - the negative control: D given the KV of another prompt of the same length answers differently,
    so the equality above could fail;
  - 8 concurrent clients over the same prompts, equal again;
  - a client that disconnects mid-stream leaves no KV blocks held on either server;
  - pull: the same 20 prompts and 8 clients, equal;
  - both: every streamed one gets its first token from P's answer (the router's default) and the rest
    from D's continuation of it (pull: D's prompt is P's plus P's token, one more prompt token on D than
    sent), with the one engine's usage;
  - push behind a router that sends D's leg once P answered (``--push-decode-after-prefill``): equal,
    D computing none of the prompt;
  - the push pair runs with the request timeline on (``KVPUSH_TIMELINE``): one request's timeline has
    every event of the router, both connectors and both engines, in causal order;
  - a mode mismatch (P pull, D push) is refused at the handshake with proto's message on D, and both
    servers keep serving.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

import servers as srv
import tiny_model

LENGTHS = [30, 45, 64, 90, 128, 150, 200, 256, 300, 333, 400, 450, 512, 517, 600, 640, 700, 777, 850, 900]
MAX_TOKENS = 12
PROMPTS = tiny_model.make_prompts(LENGTHS, seed=11)


kvpush_config = srv.kvpush_config


@pytest.fixture(scope="module")
def reference(servers: "object", vllm_ready: str) -> list[srv.Completion]:
    return srv.outputs_alone(servers, "kvp-single", PROMPTS, MAX_TOKENS)


def start_pair(
    servers: "object", tag: str, p_mode: str, d_mode: str, env: dict[str, str] | None = None
) -> tuple[srv.VllmServer, srv.VllmServer]:
    # Each config is a function of the side-channel port start_vllm picks (it picks again if the port
    # was taken before the server bound it).
    env = {"KVPUSH_LOG": os.environ.get("KVPUSH_TEST_LOG", "info"), **(env or {})}
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            servers.vllm,
            f"{tag}-P",
            kv_transfer_config=functools.partial(kvpush_config, "prefill", p_mode, f"{tag}-prefill"),
            extra_env=env,
        )
        d = pool.submit(
            servers.vllm,
            f"{tag}-D",
            kv_transfer_config=functools.partial(kvpush_config, "decode", d_mode, f"{tag}-decode"),
            extra_env=env,
        )
        return p.result(), d.result()


wait_idle = srv.wait_idle


@pytest.fixture(scope="module")
def push_pair(servers: "object", reference: list[srv.Completion], tmp_path_factory: pytest.TempPathFactory):
    env = {"KVPUSH_TIMELINE": str(tmp_path_factory.mktemp("timeline"))}
    p, d = start_pair(servers, "kvp-push", "push", "push", env)
    router = servers.router("push", [p], [d], name="router-kvp-push", extra_env=env)
    yield p, d, router
    for s in (router, d, p):
        servers.stop(s)


def test_push_matches_single_engine_and_d_computes_nothing(push_pair, reference) -> None:
    p, d, router = push_pair
    before = d.prompt_tokens_by_source()
    print(f"\nkvpush push behind kvpush router: P {p.url}, D {d.url}, router {router.url}")
    for i, (n, ref) in enumerate(zip(LENGTHS, reference)):
        got = srv.complete(router.url, PROMPTS[i], MAX_TOKENS, stream=(i % 2 == 1))
        same = got.token_ids == ref.token_ids
        worst = srv.logprob_gap(got, ref)
        print(f"  {n:4d} tokens: tokens {'equal' if same else 'DIFFER'}, logprobs within {worst:.1e}"
              f"{' TTFT %.3f s' % got.ttft_s if got.ttft_s else ''}")
        srv.assert_same_output(got, ref, f"push, {n}-token prompt")
        check_usage(got, n, i % 2 == 1)
    srv.check_transfer_counted(d, before, LENGTHS)
    recovered = requests.get(router.url + "/metrics", timeout=10).text
    print("  " + next(ln for ln in recovered.splitlines() if ln.startswith("kvpush_router_first_token_recoveries")))


def test_push_with_d_leg_after_p_answer_matches_single_engine(servers: "object", push_pair, reference) -> None:
    """``kvpush router --push-decode-after-prefill true`` on the same pair: a streamed greedy request's D
    leg leaves only once P answered (P's blocks wait for D's registration), and the client still gets
    the one engine's tokens, logprobs and usage, D computing none of the prompt."""
    p, d, _ = push_pair
    router = servers.router("push", [p], [d], name="router-kvp-push-after",
                            extra_args=["--push-decode-after-prefill", "true"])  # fmt: skip
    try:
        picked = list(range(1, len(LENGTHS), 3))
        before = d.prompt_tokens_by_source()
        for i in picked:
            got = srv.complete(router.url, PROMPTS[i], MAX_TOKENS, stream=True)
            srv.assert_same_output(got, reference[i], f"push, D's leg after P's answer, {LENGTHS[i]}-token prompt")
            check_usage(got, LENGTHS[i], True)
        srv.check_transfer_counted(d, before, [LENGTHS[i] for i in picked])
        print(f"\n  D's leg after P's answer: {len(picked)} streamed completions equal to the engine alone's")
    finally:
        servers.stop(router)


def check_usage(got: srv.Completion, n: int, streamed: bool) -> None:
    """A streamed greedy completion's first token comes from P and the rest from D's continuation of it
    (docs/router.md): its usage must still be the one engine's (P's token is output, not prompt)."""
    if streamed:
        assert got.usage is not None, "stream_options.include_usage asked for usage"
        assert (got.usage["prompt_tokens"], got.usage["completion_tokens"]) == (n, MAX_TOKENS), got.usage


# Every event of a push request, in an order each must respect (kvpush/_timeline.py names them).
PUSH_EVENTS_IN_ORDER = [
    ["router_recv", "router_d_sent", "d_sched", "d_alloc", "d_register", "eng_register_sent"],
    # P hands the blocks to the engine when the prefill's forward pass ends, before vLLM finishes it.
    ["router_recv", "router_p_sent", "p_sched", "p_release", "eng_blocks_ready"],
    ["p_release", "p_finished"],
    ["eng_register_sent", "eng_registration_read", "eng_registration_recv", "eng_rendezvous"],
    ["eng_blocks_ready", "eng_rendezvous", "eng_write_post", "eng_write_done", "eng_released", "p_reported"],
    ["eng_write_post", "eng_notified", "eng_received", "d_reported", "d_kv_ready", "d_scheduled"],
    ["d_scheduled", "d_token_step"],
    ["router_d_sent", "router_d_head", "router_first_byte"],
    ["router_p_sent", "router_p_done"],
]


def test_push_timeline_records_every_event(push_pair) -> None:
    from kvpush import timeline

    p, d, router = push_pair
    folder = p.env["KVPUSH_TIMELINE"]
    before = set(timeline.load([folder]))
    srv.complete(router.url, PROMPTS[4], 4, stream=True)
    deadline = time.monotonic() + 10  # P's release and D's next step come after the client's last byte
    while True:
        new = {t: e for t, e in timeline.load([folder]).items() if t not in before}
        events = next(iter(new.values())) if len(new) == 1 else {}
        if all(ev in events for chain in PUSH_EVENTS_IN_ORDER for ev in chain) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(new) == 1, f"one request, timelines of {len(new)} transfers"
    print("\n" + "\n".join(timeline.request_lines(events)))
    for chain in PUSH_EVENTS_IN_ORDER:
        missing = [ev for ev in chain if ev not in events]
        assert not missing, f"events {missing} not recorded; got {sorted(events)}"
        times = [events[ev] for ev in chain]
        assert times == sorted(times), f"out of order: {list(zip(chain, times))}"
    # The client's first token is P's answer where it came before D's (docs/router.md), else D's.
    before_first = ["router_p_done", "router_p_token"] if "router_p_token" in events else ["d_scheduled"]
    late = [ev for ev in before_first if events[ev] > events["router_first_byte"]]
    assert not late, f"{late} after router_first_byte: {sorted(events.items(), key=lambda kv: kv[1])}"


def test_negative_control_wrong_kv_changes_the_output(push_pair, reference) -> None:
    """D gets, under one transfer id, the KV P computed for another prompt of the same length."""
    p, d, _ = push_pair
    n = 200
    a = tiny_model.make_prompts([n], seed=101)[0]
    b = tiny_model.make_prompts([n], seed=202)[0]
    assert a != b
    tid = uuid.uuid4().hex
    p_body = srv.completion_body(a, 1, True, False)
    p_body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": tid}
    d_body = srv.completion_body(b, MAX_TOKENS, True, False)
    d_body["kv_transfer_params"] = srv.consumer_params(p, tid)
    with ThreadPoolExecutor(2) as pool:
        d_fut = pool.submit(requests.post, d.url + "/v1/completions", json=d_body, timeout=120)
        p_fut = pool.submit(requests.post, p.url + "/v1/completions", json=p_body, timeout=120)
        assert p_fut.result().status_code == 200
        d_resp = d_fut.result()
    assert d_resp.status_code == 200, d_resp.text
    tokens = [int(t.split(":")[1]) for t in d_resp.json()["choices"][0]["logprobs"]["tokens"]]
    right = srv.complete(d.url, b, MAX_TOKENS)  # D alone, computing b itself
    print(f"\n  D with a's KV for b: {tokens[:8]}..., D computing b: {right.token_ids[:8]}...")
    assert tokens != right.token_ids, "D's output did not change with the wrong KV: the check could not fail"


def test_push_eight_concurrent_clients(push_pair, reference) -> None:
    p, d, router = push_pair
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: srv.complete(router.url, PROMPTS[i], MAX_TOKENS), range(len(PROMPTS))))
    worst = max(
        srv.assert_same_output(got, ref, f"push, 8 clients, {n}-token prompt")
        for n, got, ref in zip(LENGTHS, outs, reference)
    )
    print(f"\n  8 concurrent clients: {len(outs)} completions, tokens equal, logprobs within {worst:.2e}")


def test_client_disconnect_leaves_no_blocks_held(push_pair) -> None:
    p, d, router = push_pair
    body = srv.completion_body(PROMPTS[-1], 400, False, True)
    with requests.post(router.url + "/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            break  # the first event arrived (P's token, or D's): the KV may still be on its way; hang up
    p_state, d_state = wait_idle(p), wait_idle(d)
    print(f"\n  after the disconnect: P kv usage/requests {p_state}, D {d_state}")
    assert p_state == (0, 0), f"P still holds KV blocks or requests: {p_state}"
    assert d_state == (0, 0), f"D still holds KV blocks or requests: {d_state}"
    # Both still serve.
    srv.complete(router.url, PROMPTS[0], 4)


def test_pull_matches_single_engine(servers: "object", reference) -> None:
    p, d = start_pair(servers, "kvp-pull", "pull", "pull")
    router = servers.router("pull", [p], [d], name="router-kvp-pull")
    try:
        before = d.prompt_tokens_by_source()
        for i, (n, ref) in enumerate(zip(LENGTHS, reference)):
            got = srv.complete(router.url, PROMPTS[i], MAX_TOKENS, stream=(i % 3 == 0))
            srv.assert_same_output(got, ref, f"pull, {n}-token prompt")
            check_usage(got, n, i % 3 == 0)
        after = d.prompt_tokens_by_source()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        print(f"\nkvpush pull: {len(PROMPTS)} prompts equal; D's prompt tokens by source: {delta}")
        assert delta.get("local_compute", 0) <= len(PROMPTS), delta
        # A streamed one went to D as its continuation of P's token (one prompt token more, whose
        # position is the one D computes); the others as the client's prompt.
        streamed = sum(1 for i in range(len(PROMPTS)) if i % 3 == 0)
        assert sum(delta.values()) == sum(LENGTHS) + streamed, delta
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: srv.complete(router.url, PROMPTS[i], MAX_TOKENS), range(len(PROMPTS))))
        for n, got, ref in zip(LENGTHS, outs, reference):
            srv.assert_same_output(got, ref, f"pull, 8 clients, {n}-token prompt")
    finally:
        for s in (router, d, p):
            servers.stop(s)


def test_mode_mismatch_is_refused_and_nobody_crashes(servers: "object") -> None:
    p, d = start_pair(servers, "kvp-mismatch", "pull", "push")
    router = servers.router("push", [p], [d], name="router-kvp-mismatch")
    try:
        try:
            srv.complete(router.url, PROMPTS[3], 4)
        except srv.ServerError as e:
            print(f"\n  the request failed: {str(e)[:200]}")
        log = d.log_tail(400)
        assert "mode" in log and "push" in log and "pull" in log and "refused" in log.lower(), log[-3000:]
        line = next((l for l in log.splitlines() if "refused" in l.lower()), "")
        print(f"  D's log: {line.strip()[:300]}")
        assert p.alive() and d.alive(), "a server exited"
        # Each still answers on its own.
        srv.complete(p.url, PROMPTS[0], 2)
        srv.complete(d.url, PROMPTS[0], 2)
    finally:
        for s in (router, d, p):
            servers.stop(s)
