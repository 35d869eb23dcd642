"""P and D of different TP sizes: real vLLM CPU servers (vLLM CPU runs TP as one process per rank).

Four pairs, each a few prompts through vLLM's toy-proxy conventions (``servers.vllm_proxy_complete``):

- ``P2-D1-pull``: P TP 2 → D TP 1 over the tiny model's two KV heads, pull mode. D's one rank reads a
  head from each P rank, at the addresses P's scheduler learnt from its workers' handshake metadata
  (``remote_ranks``). P's workers publish the host ``localhost`` (``KVPUSH_SIDE_CHANNEL_HOST``) while
  ``remote_host`` says ``127.0.0.1``: D's log naming ``localhost`` shows it dialed what P published.
- ``P1-D2-push``: P TP 1 → D TP 2, push mode: P's one rank writes head 0 into D rank 0 and head 1 into
  D rank 1.
- ``P2-D1-replicated``: P TP 2 → D TP 1 on a tiny model with **one** KV head, push mode: both P ranks
  hold the same head, D reads it from P rank 0, and P rank 1 must be told to release (it is otherwise
  held until its lease, 120 s here, far beyond the test's wait).
- ``P-DP2-D1-push``: P runs two data-parallel engines (``--data-parallel-size 2``, TP 1 each), push
  mode. Each DP engine listens on its own port (side_channel_port + DP index) under the engine id vLLM
  renames to ``<engine_id>_dp<i>``; P's answer names the engine that prefilled, and D dials it there.
  The prompts go two at a time, so that vLLM's DP balancer has both engines busy.

Each checks: tokens equal to one engine alone (the pair's TP 1 server computing the prompt itself) and
logprobs within ``servers.LOGPROB_TOLERANCE``; D computed at most each prompt's last token
(``vllm:prompt_tokens_by_source``); every P rank reported every request released (the connector's
``vllm:kvpush_requests_sent``, counted once per rank) with no lease expired; afterwards both servers
hold no KV block and no request. Each pair's time is mostly its two server starts (one process per TP
rank): 11 minutes for ``P2-D1-replicated`` on the development machine at load average 30, 6 s of it
the requests. ``KVPUSH_TOPOLOGIES`` picks pairs by id (comma-separated; unset: all four, under
``CI=true`` the two of ``CI_PAIRS``).
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import servers as srv
import tiny_model

LENGTHS = [45, 200, 517]
MAX_TOKENS = 8
PROMPTS = tiny_model.make_prompts(LENGTHS, seed=47)
LEASE_MS = 120_000

# id: (P TP, D TP, KV heads, mode)
PAIRS = {
    "P2-D1-pull": (2, 1, 2, "pull"),
    "P1-D2-push": (1, 2, 2, "push"),
    "P2-D1-replicated": (2, 1, 1, "push"),
    "P-DP2-D1-push": (1, 1, 2, "push"),
}
# Data-parallel engines on P (1 where not named).
P_DP = {"P-DP2-D1-push": 2}
# CI (2 cores, 90 minutes for everything) runs the two pairs that cover P TP above D's, below it and above
# the KV heads; the pull pair (the published rank addresses, also unit-tested) and the DP pair when asked
# for. P1-D2-push takes about 5.5 minutes on the development machine at load average 30, nearly all of
# it the two server starts (docs/benchmarks.md).
CI_PAIRS = ["P2-D1-replicated", "P1-D2-push"]
CHOSEN = [
    p for p in os.environ.get("KVPUSH_TOPOLOGIES", ",".join(CI_PAIRS if srv.IN_CI else PAIRS)).split(",") if p
]


def side_ports(n: int, avoid: list[int]) -> int:
    """A free port whose next ``n - 1`` ports are free too (rank r listens on port + r)."""
    while True:
        base = srv.free_port(avoid)
        if all(srv._bindable(base + i) for i in range(1, n)):
            return base


kvpush_sum = srv.kvpush_sum


@pytest.fixture(scope="module", params=CHOSEN)
def pair(request: pytest.FixtureRequest, servers: Any) -> Any:
    tag = request.param
    p_tp, d_tp, heads, mode = PAIRS[tag]
    p_dp = P_DP.get(tag, 1)
    model = tiny_model.model_dir(tiny_model.TinyLlama(num_key_value_heads=heads))
    p_port = side_ports(p_tp * p_dp, [])
    d_port = side_ports(d_tp, list(range(p_port, p_port + p_tp * p_dp)))
    p_args = ["--tensor-parallel-size", str(p_tp)] + (["--data-parallel-size", str(p_dp)] if p_dp > 1 else [])
    env = {"KVPUSH_LOG": os.environ.get("KVPUSH_TEST_LOG", "info")}
    p_env = {**env, "KVPUSH_SIDE_CHANNEL_HOST": "localhost"} if mode == "pull" else env
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            servers.vllm, f"{tag}-P", model_dir=model, side_channel_port=p_port, extra_env=p_env,
            kv_transfer_config=srv.kvpush_config("prefill", mode, f"{tag}-prefill", p_port, lease_ms=LEASE_MS),
            extra_args=p_args,
        )  # fmt: skip
        d = pool.submit(
            servers.vllm, f"{tag}-D", model_dir=model, side_channel_port=d_port, extra_env=env,
            kv_transfer_config=srv.kvpush_config("decode", mode, f"{tag}-decode", d_port),
            extra_args=["--tensor-parallel-size", str(d_tp)],
        )  # fmt: skip
        p, d = p.result(), d.result()
    alone = p if p_tp == 1 and p_dp == 1 else d
    reference = [srv.complete(alone.url, prompt, MAX_TOKENS) for prompt in PROMPTS]
    yield tag, p, d, reference
    servers.stop(d, p)


def test_tp_pairs_match_one_engine_and_every_p_rank_releases(pair: Any) -> None:
    tag, p, d, reference = pair
    p_tp, d_tp, heads, mode = PAIRS[tag]
    started = time.monotonic()
    before_d = d.prompt_tokens_by_source()
    sent_before = kvpush_sum(p, "vllm:kvpush_requests_sent_total")
    p_dp = P_DP.get(tag, 1)

    def one(prompt: list[int]) -> srv.Completion:
        return srv.vllm_proxy_complete(p.url, d.url, prompt, MAX_TOKENS, push=(mode == "push"))

    with ThreadPoolExecutor(p_dp) as pool:
        outputs = list(pool.map(one, PROMPTS))
    for got, n, ref in zip(outputs, LENGTHS, reference):
        print(f"  {tag}, {n:4d} tokens: {got.token_ids[:6]}..., logprobs within {srv.logprob_gap(got, ref):.1e}")
        srv.assert_same_output(got, ref, f"{tag}, {n}-token prompt")
    srv.check_transfer_counted(d, before_d, LENGTHS)
    # Every P rank reports each request released (its outcome, counted per rank), well before the
    # lease: vLLM frees a request's blocks on P only once every rank has.
    for s in (p, d):
        assert srv.wait_idle(s, 30) == (0, 0), f"{s.name} still holds KV blocks or requests"
    sent = kvpush_sum(p, "vllm:kvpush_requests_sent_total") - sent_before
    expired = kvpush_sum(p, "vllm:kvpush_num_kv_expired_reqs_total")
    took = time.monotonic() - started
    print(f"  P's ranks reported {sent:.0f} releases for {len(PROMPTS)} requests; leases expired: {expired:.0f}; "
          f"{took:.1f} s")  # fmt: skip
    assert sent == p_tp * len(PROMPTS), (sent, p_tp)
    assert expired == 0
    assert took < LEASE_MS / 1000, "a P rank may have been released by its lease"
    if mode == "pull":
        # D dialed each P rank at the address P published (localhost), not remote_host (127.0.0.1) + r.
        log = d.log_path.read_text(errors="replace")
        for r in range(p_tp):
            assert f"localhost:{p.side_channel_port + r}" in log, f"D's log names no dial to P rank {r} at localhost"
    if p_dp > 1:
        # D dialed P's DP engines under vLLM's renamed ids, each at its own port (DP index i: port + i).
        log = re.sub(r"\x1b\[[0-9;]*m", "", d.log_path.read_text(errors="replace"))  # tracing's colours
        dialed = sorted(set(re.findall(rf"producer={re.escape(tag)}-prefill_dp(\d+) addr=\S+:(\d+)", log)))
        print(f"  D dialed P's DP engines (index, port): {dialed}")
        assert dialed, "D's log names no dial to a renamed DP engine"
        for index, port in dialed:
            assert int(port) == p.side_channel_port + int(index) * p_tp, (index, port, p.side_channel_port)
    for s in (p, d):
        assert s.alive()
