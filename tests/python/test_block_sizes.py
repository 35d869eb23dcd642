"""P and D with different block sizes (64/128 and 128/64): real vLLM CPU servers, kvpush push.

vLLM's CPU backend packs the tokens of a block by block size (per ISA), so a 64-token block's bytes are
not the first half of a 128-token block's: the engine refuses to map its ``head_joint`` blocks between
different sizes (a first run that did copy them gave D wrong tokens: ``[712, 141, 542, …]`` where
``[718, 976, 759, …]`` was right). What these tests prove on CPU is that the refusal is loud and safe:
with vLLM's ``recompute`` load-failure policy D answers every prompt exactly as computing it alone
(tokens exact, logprobs within ``servers.LOGPROB_TOLERANCE``), having computed the prompts itself
(``vllm:prompt_tokens_by_source``: nothing counted as transferred), P's log names both block sizes,
nothing is held afterwards, and both servers keep serving. The token mapping between different block
sizes is checked byte for byte on token-exact layouts in tests/engine/engine_matrix.rs.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import servers as srv
import tiny_model

# 100: inside a block on both sides; 192: a 64-block boundary inside a 128-block; 256: both.
LENGTHS = [100, 192, 256, 517]
MAX_TOKENS = 8
PROMPTS = tiny_model.make_prompts(LENGTHS, seed=31)


def recompute(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with vLLM's ``recompute`` policy for KV that fails to load (its default fails the request)."""
    return {**cfg, "kv_load_failure_policy": "recompute"}


@pytest.fixture(scope="module", params=[(64, 128), (128, 64)], ids=["P64-D128", "P128-D64"])
def pair(request: pytest.FixtureRequest, servers: Any) -> Any:
    p_block, d_block = request.param
    p_port, d_port = srv.free_ports(2)
    env = {"KVPUSH_LOG": os.environ.get("KVPUSH_TEST_LOG", "info")}
    tag = f"blk{p_block}-{d_block}"
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            servers.vllm, f"{tag}-P", side_channel_port=p_port, extra_env=env,
            kv_transfer_config=recompute(srv.kvpush_config("prefill", "push", f"{tag}-prefill", p_port)),
            extra_args=["--block-size", str(p_block)],
        )  # fmt: skip
        d = pool.submit(
            servers.vllm, f"{tag}-D", side_channel_port=d_port, extra_env=env,
            kv_transfer_config=recompute(srv.kvpush_config("decode", "push", f"{tag}-decode", d_port)),
            extra_args=["--block-size", str(d_block)],
        )  # fmt: skip
        p, d = p.result(), d.result()
    reference = [srv.complete(d.url, prompt, MAX_TOKENS) for prompt in PROMPTS]
    yield p, d, reference, p_block, d_block
    for s in (d, p):
        servers.stop(s)


def test_cpu_blocks_of_different_sizes_are_refused_and_d_recomputes(pair: Any) -> None:
    p, d, reference, p_block, d_block = pair
    before = d.prompt_tokens_by_source()
    for prompt, n, ref in zip(PROMPTS, LENGTHS, reference):
        got = srv.vllm_proxy_complete(p.url, d.url, prompt, MAX_TOKENS, push=True)
        print(f"  {p.name} -> {d.name}, {n:4d} tokens: {got.token_ids[:6]}..., logprobs within {srv.logprob_gap(got, ref):.1e}")
        srv.assert_same_output(got, ref, f"{p.name} -> {d.name}, {n}-token prompt")
    after = d.prompt_tokens_by_source()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(f"  D's prompt tokens by source: {delta}")
    assert delta.get("external_kv_transfer", 0) == 0, delta
    assert delta.get("local_compute", 0) >= sum(LENGTHS) - len(LENGTHS), delta
    refusal = f"{p_block}-token and {d_block}-token blocks cannot be mapped"
    log = p.log_path.read_text(errors="replace")
    assert log.count(refusal) >= len(PROMPTS), f"P's log does not say {refusal!r} per request"
    print(f"  P's log: {refusal} ... ({log.count(refusal)} times)")
    for s in (p, d):
        assert srv.wait_idle(s, 30) == (0, 0), f"{s.name} still holds KV blocks or requests"
        assert s.alive()
    srv.complete(p.url, PROMPTS[0], 2)
    srv.complete(d.url, PROMPTS[0], 2)
