"""kvpush's connector at the borders of a request's life, on real vLLM CPU servers (issue 17).

One P and one D in push mode, driven directly (P's leg, then D's with P's answer, as vLLM's own push
proxy does; ``servers.vllm_proxy_complete``):

- **metrics**: after a transfer, both servers' Prometheus ``/metrics`` show kvpush's figures moving —
  P's transfer count, bytes (whole blocks of the prompt: at least its tokens, less than one block
  more), transfer and post times and descriptors; D's requests registered and received — and every
  ``vllm:kvpush_*`` name exists before the first transfer;
- **prefix caching on D** (item 6): prompts sharing 400 and 200 tokens with one D served before hit
  D's prefix cache partly; outputs equal P computing them alone, D computes at most the last prompt
  token, and P moves only the blocks from the first one D does not hold (its bytes metric);
- **a request dropped while queued on D** (item 7): D runs one request at a time, a long local one
  holds the slot, P prefills a second and holds its blocks (lease 120 s), D's leg queues and its
  client leaves: P frees the blocks within seconds, while D's slot is still taken.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import pytest

import servers as srv
import tiny_model

MAX_TOKENS = 8
# K and V of every layer and KV head of one token, float32 (tiny_model.TinyLlama).
_T = tiny_model.TinyLlama()
TOKEN_BYTES = 2 * _T.num_hidden_layers * _T.num_key_value_heads * _T.head_dim * 4
LARGEST_BLOCK = 128
METRIC_NAMES = (
    "vllm:kvpush_xfer_time_seconds_count",
    "vllm:kvpush_post_time_seconds_count",
    "vllm:kvpush_bytes_transferred_count",
    "vllm:kvpush_num_descriptors_count",
    "vllm:kvpush_num_failed_transfers_total",
    "vllm:kvpush_num_failed_notifications_total",
    "vllm:kvpush_num_kv_expired_reqs_total",
    "vllm:kvpush_failures_total",
    "vllm:kvpush_requests_registered_total",
    "vllm:kvpush_requests_sent_total",
    "vllm:kvpush_requests_received_total",
)


class Pair:
    def __init__(self, p: srv.VllmServer, d: srv.VllmServer) -> None:
        self.p, self.d = p, d


@pytest.fixture(scope="module")
def pair(servers: Any) -> Any:
    p_port, d_port = srv.free_ports(2)
    env = {"KVPUSH_LOG": os.environ.get("KVPUSH_TEST_LOG", "info")}
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            servers.vllm, "borders-P", side_channel_port=p_port, extra_env=env,
            kv_transfer_config=srv.kvpush_config("prefill", "push", "borders-prefill", p_port, lease_ms=120_000),
        )  # fmt: skip
        # D with prefix caching (partial hits) and one request at a time (a second one queues).
        d = pool.submit(
            servers.vllm, "borders-D", side_channel_port=d_port, extra_env=env, prefix_caching=True,
            extra_args=["--max-num-seqs", "1"],
            kv_transfer_config=srv.kvpush_config("decode", "push", "borders-decode", d_port),
        )  # fmt: skip
        p, d = p.result(), d.result()
    yield Pair(p, d)
    for s in (d, p):
        servers.stop(s)


kvpush_sum = srv.kvpush_sum


def wait_moved(server: srv.VllmServer, name: str, before: float, timeout_s: float = 20.0) -> float:
    """Waits until ``name`` on ``server`` exceeds ``before`` (published once a step's stats reach the
    front end); returns its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = kvpush_sum(server, name)
        if now > before or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def test_kvpush_figures_reach_vllm_metrics(pair: Pair) -> None:
    p, d = pair.p, pair.d
    for server in (p, d):
        samples = server.metrics()
        missing = [n for n in METRIC_NAMES if not any(k.split("{")[0] == n for k in samples)]
        assert not missing, f"{server.name}: no {missing} in /metrics"
    n = 300
    [prompt] = tiny_model.make_prompts([n], seed=31)
    reference = srv.complete(p.url, prompt, MAX_TOKENS)  # P alone, computing the prompt itself
    names = ("bytes_transferred_count", "bytes_transferred_sum", "xfer_time_seconds_count",
             "post_time_seconds_count", "num_descriptors_count", "num_descriptors_sum")  # fmt: skip
    before = {k: kvpush_sum(p, f"vllm:kvpush_{k}") for k in names}
    d_before = {k: kvpush_sum(d, f"vllm:kvpush_{k}") for k in ("requests_registered_total", "requests_received_total")}
    by_source = d.prompt_tokens_by_source()
    got = srv.vllm_proxy_complete(p.url, d.url, prompt, MAX_TOKENS, push=True, transfer_id=str(uuid.uuid4()))
    srv.assert_same_output(got, reference, "push with metrics")
    srv.check_transfer_counted(d, by_source, [n])
    wait_moved(p, "vllm:kvpush_bytes_transferred_count", before["bytes_transferred_count"])
    wait_moved(d, "vllm:kvpush_requests_received_total", d_before["requests_received_total"])
    delta = {k: kvpush_sum(p, f"vllm:kvpush_{k}") - v for k, v in before.items()}
    d_delta = {k: kvpush_sum(d, f"vllm:kvpush_{k}") - v for k, v in d_before.items()}
    print(f"\n  P's kvpush figures for one {n}-token request: {delta}\n  D's: {d_delta}")
    # One transfer (P TP 1 -> D TP 1), whole blocks of the prompt.
    assert delta["bytes_transferred_count"] == 1, delta
    assert n * TOKEN_BYTES <= delta["bytes_transferred_sum"] < (n + LARGEST_BLOCK) * TOKEN_BYTES, delta
    assert delta["xfer_time_seconds_count"] == delta["post_time_seconds_count"] == 1, delta
    assert delta["num_descriptors_count"] == 1 and delta["num_descriptors_sum"] >= 1, delta
    assert d_delta == {"requests_registered_total": 1, "requests_received_total": 1}, d_delta
    for s in (p, d):
        assert srv.wait_idle(s, 30) == (0, 0), f"{s.name} still holds KV blocks or requests"


def test_prefix_hits_on_d_move_only_the_rest(pair: Pair) -> None:
    p, d = pair.p, pair.d
    [a, b_tail, c_tail] = tiny_model.make_prompts([520, 150, 37], seed=41)
    # D computes nothing of A but its last token: the whole prompt comes from P, and D's prefix cache
    # keeps A's blocks afterwards.
    by_source = d.prompt_tokens_by_source()
    srv.assert_same_output(
        srv.vllm_proxy_complete(p.url, d.url, a, MAX_TOKENS, push=True, transfer_id=str(uuid.uuid4())),
        srv.complete(p.url, a, MAX_TOKENS),
        "A, nothing cached on D",
    )
    srv.check_transfer_counted(d, by_source, [len(a)])
    # B and C share 400 and 200 tokens with A: D holds those blocks, only the rest moves.
    for name, prompt, shared in (("B", a[:400] + b_tail, 400), ("C", a[:200] + c_tail, 200)):
        reference = srv.complete(p.url, prompt, MAX_TOKENS)
        before = d.prompt_tokens_by_source()
        moved_before = kvpush_sum(p, "vllm:kvpush_bytes_transferred_sum")
        count_before = kvpush_sum(p, "vllm:kvpush_bytes_transferred_count")
        got = srv.vllm_proxy_complete(p.url, d.url, prompt, MAX_TOKENS, push=True, transfer_id=str(uuid.uuid4()))
        srv.assert_same_output(got, reference, f"{name}: {shared} of {len(prompt)} tokens cached on D")
        after = d.prompt_tokens_by_source()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        hit = delta.get("local_cache_hit", 0)
        wait_moved(p, "vllm:kvpush_bytes_transferred_count", count_before)
        moved = kvpush_sum(p, "vllm:kvpush_bytes_transferred_sum") - moved_before
        print(f"\n  {name}: {len(prompt)} tokens, D: {delta}, P moved {moved / TOKEN_BYTES:.0f} tokens' KV")
        # A partial hit: whole blocks of the shared prefix, at most all of it.
        assert shared - LARGEST_BLOCK < hit <= shared, delta
        # The rest came from P (D computing at most the last prompt token)...
        assert delta.get("local_compute", 0) <= 1, delta
        assert delta.get("external_kv_transfer", 0) >= len(prompt) - hit - 1, delta
        # ...and only the rest moved: whole blocks from the first one D did not hold.
        assert (len(prompt) - hit) * TOKEN_BYTES <= moved < (len(prompt) - hit + LARGEST_BLOCK) * TOKEN_BYTES, moved
    for s in (p, d):
        assert srv.wait_idle(s, 30) == (0, 0), f"{s.name} still holds KV blocks or requests"


def waiting_requests(server: srv.VllmServer) -> float:
    return kvpush_sum(server, "vllm:num_requests_waiting")


def _post_without_waiting(url: str, body: dict[str, Any]) -> socket.socket:
    """Sends a POST and returns its open socket without reading anything: a client whose request
    stays queued (a streaming response may send no header before its first token) and that can
    go away at any moment (close the socket)."""
    u = urlsplit(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=10)
    head = (
        f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_request_dropped_while_queued_on_d_frees_p_at_once(pair: Pair) -> None:
    p, d = pair.p, pair.d
    [hog_prompt, prompt] = tiny_model.make_prompts([20, 200], seed=43)
    # P prefills the prompt and holds its blocks for D (its lease is 120 s).
    tid = str(uuid.uuid4())
    p_params = {"do_remote_decode": True, "transfer_id": tid}
    first = srv.complete(p.url, prompt, 1, extra={"kv_transfer_params": p_params})
    assert srv.kv_usage(p) > 0, "P holds nothing for D"
    with ThreadPoolExecutor(1) as pool:
        # D runs one request at a time (--max-num-seqs 1): a long local one takes the slot. It starts
        # after P's prefill, so P's time cannot use it up.
        hog = pool.submit(srv.complete, d.url, hog_prompt, 3000, False)
        deadline = time.monotonic() + 60
        while kvpush_sum(d, "vllm:num_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kvpush_sum(d, "vllm:num_requests_running") >= 1, "the long request never ran on D"
        # D's leg queues behind the long request; then its client goes away.
        dropped = kvpush_sum(d, "vllm:kvpush_requests_dropped_total")
        d_params = first.kv_transfer_params
        body = srv.completion_body(prompt, MAX_TOKENS, True, True, extra={"kv_transfer_params": d_params})
        client = _post_without_waiting(d.url + "/v1/completions", body)
        while waiting_requests(d) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert waiting_requests(d) >= 1, "D's leg never waited"
        client.close()
        t0 = time.monotonic()
        while srv.kv_usage(p) > 0 and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        took = time.monotonic() - t0
        print(f"\n  P freed the dropped request's blocks {took:.1f} s after D's client left (lease 120 s)")
        assert srv.kv_usage(p) == 0 and took < 30, took
        # The request was dropped before D allocated it, not allocated and then ended: D counts only
        # the first as dropped. (Whether the long request still holds D's slot by now depends on the
        # machine's speed: on an idle host it can finish within the seconds the drop takes.)
        assert wait_moved(d, "vllm:kvpush_requests_dropped_total", dropped) == dropped + 1
        hog.result()
    for s in (p, d):
        assert srv.wait_idle(s, 30) == (0, 0), f"{s.name} still holds KV blocks or requests"
