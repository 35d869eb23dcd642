"""kvpush's connector at the borders of a request's life, on real vLLM CPU servers (issue 17).

One P and one D in push mode, driven directly (P's leg, then D's with P's answer, as vLLM's own push
proxy does; ``servers.vllm_proxy_complete``):

- **metrics**: after a transfer, both servers' Prometheus ``/metrics`` show kvpush's figures moving —
  P's transfer count, bytes (whole blocks of the prompt: at least its tokens, less than one block
  more), transfer and post times and descriptors; D's requests registered and received — and every
  ``vllm:kvpush_*`` name exists before the first transfer.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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
            kv_transfer_config=srv.kvpush_config("prefill", "push", "borders-prefill", p_port),
        )  # fmt: skip
        d = pool.submit(
            servers.vllm, "borders-D", side_channel_port=d_port, extra_env=env,
            kv_transfer_config=srv.kvpush_config("decode", "push", "borders-decode", d_port),
        )  # fmt: skip
        p, d = p.result(), d.result()
    yield Pair(p, d)
    for s in (d, p):
        servers.stop(s)


def kvpush_sum(server: srv.VllmServer, name: str) -> float:
    """The samples of ``name`` summed over labels (engines, failure kinds)."""
    return sum(v for k, v in server.metrics().items() if k == name or k.startswith(name + "{"))


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

