"""Quarantined blocks on real vLLM CPU servers (issue 16): D holds a lost producer's blocks until released.

D registers a request with P (push), P is killed with SIGKILL before it writes. Over NIXL the engine
cannot confirm that a lost peer's WRITEs stopped (docs/reliability.md), so D's engine ends the
request "quarantined": vLLM answers the request with an error at once (``kv_load_failure_policy``
``fail``), but its KV blocks stay allocated while nothing runs — the late WRITE of a lost producer
could still land in them. The engine releases them when P comes back as a new process (same engine
id and side-channel port) and D reaches it again, or at its 120 s bound, whichever comes first (on a
loaded machine P's restart can take longer); then D holds no block, and serves a new request from the
new P's KV, its output equal to D's own. Before the connector held them, D freed the blocks in the
step the quarantine was reported.
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import requests

import servers as srv
import tiny_model

PROMPT = tiny_model.make_prompts([300], seed=31)[0]
MAX_TOKENS = 6


def prefill(servers: "object", side_port: int | None) -> srv.VllmServer:
    config = functools.partial(srv.kvpush_config, "prefill", "push", "q-prefill")
    return servers.vllm("q-P", kv_transfer_config=config, side_channel_port=side_port)


def test_a_lost_producers_blocks_stay_held_until_released(servers: "object", vllm_ready: str) -> None:
    with ThreadPoolExecutor(2) as pool:
        p_fut = pool.submit(prefill, servers, None)
        d_fut = pool.submit(
            servers.vllm,
            "q-D",
            kv_transfer_config=functools.partial(srv.kvpush_config, "decode", "push", "q-decode"),
        )
        p, d = p_fut.result(), d_fut.result()
    side_port = p.side_channel_port
    assert srv.wait_idle(d) == (0, 0)
    # D's request for a transfer P never prefills: D allocates and registers, and waits.
    body = srv.completion_body(PROMPT, MAX_TOKENS, True, False)
    body["kv_transfer_params"] = srv.consumer_params(p, uuid.uuid4().hex)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(requests.post, d.url + "/v1/completions", json=body, timeout=120)
        deadline = time.monotonic() + 60
        while srv.kv_usage(d) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.kv_usage(d) > 0, "D never allocated blocks for the request"
        time.sleep(1.0)  # the registration reaches P
        os.killpg(p.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        r = waiting.result()
        answered_s = time.monotonic() - t0
    print(f"\n  D answered {answered_s:.2f} s after P was killed: HTTP {r.status_code} {r.text[:160]}")
    assert answered_s < 30, "the request waited for a peer that is gone"
    failed = r.status_code != 200 or r.json()["choices"][0].get("finish_reason") not in ("length", "stop")
    assert failed, f"D answered as if the KV had landed: {r.text[:300]}"
    # The request is over, its blocks are not: they stay held (quarantined) while nothing runs.
    held = []
    for _ in range(10):
        held.append((srv.kv_usage(d), srv.busy_requests(d)))
        time.sleep(0.3)
    print(f"  D's (kv usage, requests) after the answer: {held[0]} ... {held[-1]}")
    assert all(busy == 0 for _, busy in held), held
    assert all(usage > 0 for usage, _ in held), f"D freed blocks a lost producer could still write: {held}"
    log = d.log_tail(400)
    assert "quarantined" in log, log[-3000:]
    # P returns as a new process; D reaches it with the next request (which releases the old blocks,
    # unless the 120 s bound did first).
    p2 = prefill(servers, side_port)
    try:
        reference = srv.complete(d.url, PROMPT, MAX_TOKENS)  # D alone (no prefix cache on D)
        got = srv.vllm_proxy_complete(p2.url, d.url, PROMPT, MAX_TOKENS, push=True)
        srv.assert_same_output(got, reference, "after the quarantine, from the new P")
        state = srv.wait_idle(d, timeout_s=150)
        print(f"  after P's return: D's (kv usage, requests) {state}")
        assert state == (0, 0), f"D still holds blocks: {state}"
        assert "quarantined blocks released" in d.log_tail(400)
        # D's request counters: the one quarantine and nothing dropped. vLLM's serving layer follows its
        # HTTP 500 with a pre-aborted stand-in carrying the request's kv_transfer_params (it takes the
        # error for a request that never reached the engine); the transfer was registered, so the stand-in
        # is not a drop (docs/reliability.md). It used to count one.
        counts = {
            k: srv.kvpush_sum(d, f"vllm:kvpush_requests_{k}_total") for k in ("quarantined", "failed", "dropped")
        }
        print(f"  D's request counters: {counts}")
        assert "vllm:kvpush_requests_dropped_total" in "".join(d.metrics()), "D publishes no drop counter"
        assert counts == {"quarantined": 1, "failed": 1, "dropped": 0}, counts
    finally:
        for s in (d, p2, p):
            servers.stop(s)
