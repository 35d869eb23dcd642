"""A hybrid sliding-window model between real vLLM CPU servers: P/D with kvpush, push and pull.

The tiny Llama of ``tiny_model.hybrid()`` alternates full attention (layers 0, 2) and a 96-token sliding
window (layers 1, 3). vLLM's hybrid allocator (on, since the connector implements ``SupportsHMA``) makes
two KV cache groups of it, each with its own block table, whose tensors alias one allocation: layer 1
lives in layer 0's bytes, layer 3 in layer 2's, a block id belonging to one group at a time. The
connector registers each shared region once and the engine moves each group's blocks by that group's
ids, the window group only the blocks holding the last 96 tokens (vLLM frees the others).

Each test checks what vLLM built (both servers' logs name two groups, one a 96-token window, in two
shared regions), that P/D answers every prompt exactly as one engine alone (D computing each prompt
itself), that D computed at most the last token of each prompt (``vllm:prompt_tokens_by_source``), and
that neither server holds a block or request afterwards.
"""

from __future__ import annotations

import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import servers as srv
import tiny_model

WINDOW = 96
BLOCK = 32
# Shorter than the window, one window, and prompts whose windows start inside a block; 223: the token
# just before the window (127) is the last of its block, which vLLM frees on P at the end of the prompt.
LENGTHS = [30, 96, 200, 223, 257, 517, 900]
MAX_TOKENS = 12
PROMPTS = tiny_model.make_prompts(LENGTHS, seed=47)
# vLLM's own start-up line (vllm/v1/core/kv_cache_utils.py): one block size per KV cache group it built.
GROUPS = re.compile(r"kv cache group sizes \(([\d, ]+)\)")


@pytest.fixture(scope="module")
def hybrid_dir() -> Any:
    return tiny_model.model_dir(tiny_model.hybrid(layers=4, sliding_window=WINDOW))


@pytest.fixture(scope="module", params=["push", "pull"])
def pair(request: pytest.FixtureRequest, servers: Any, hybrid_dir: Any) -> Any:
    mode = request.param
    p_port, d_port = srv.free_ports(2)
    env = {"KVPUSH_LOG": os.environ.get("KVPUSH_TEST_LOG", "info")}
    args = ["--block-size", str(BLOCK)]
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            servers.vllm, f"hyb-{mode}-P", model_dir=hybrid_dir, side_channel_port=p_port, extra_env=env,
            kv_transfer_config=srv.kvpush_config("prefill", mode, f"hyb-{mode}-prefill", p_port), extra_args=args,
        )  # fmt: skip
        d = pool.submit(
            servers.vllm, f"hyb-{mode}-D", model_dir=hybrid_dir, side_channel_port=d_port, extra_env=env,
            kv_transfer_config=srv.kvpush_config("decode", mode, f"hyb-{mode}-decode", d_port), extra_args=args,
        )  # fmt: skip
        p, d = p.result(), d.result()
    # One engine alone: D (no prefix caching) computing each prompt itself, no kv_transfer_params.
    reference = [srv.complete(d.url, prompt, MAX_TOKENS) for prompt in PROMPTS]
    yield mode, p, d, reference
    servers.stop(d, p)


def test_vllm_builds_two_kv_cache_groups_and_kvpush_starts(pair: Any) -> None:
    mode, p, d, _ = pair
    for s in (p, d):
        log = s.log_path.read_text(errors="replace")
        found = GROUPS.findall(log)
        assert found, f"{s.name}: vLLM's log names no KV cache groups:\n{s.log_tail()}"
        sizes = [int(x) for x in found[0].split(",") if x.strip()]
        print(f"  {s.name}: vLLM built {len(sizes)} KV cache groups of {sizes}-token blocks")
        # The full-attention group and the sliding-window group, over one allocation (their tensors
        # alias): an engine that refused shared regions would not have started.
        assert sizes == [BLOCK, BLOCK], sizes
        assert "kvpush engine started" in log, f"{s.name}: the kvpush engine did not start:\n{s.log_tail()}"


def test_pd_equals_one_engine_and_d_computes_only_the_last_token(pair: Any) -> None:
    mode, p, d, reference = pair
    before = d.prompt_tokens_by_source()
    for i, (n, ref) in enumerate(zip(LENGTHS, reference)):
        got = srv.vllm_proxy_complete(
            p.url, d.url, PROMPTS[i], MAX_TOKENS, push=mode == "push", transfer_id=str(uuid.uuid4()), stream=i == 1
        )
        print(f"  {mode}, {n:4d} tokens: {got.token_ids[:6]}..., logprobs within {srv.logprob_gap(got, ref):.1e}")
        srv.assert_same_output(got, ref, f"hybrid {mode}, {n}-token prompt")
    srv.check_transfer_counted(d, before, LENGTHS)
    for s in (p, d):
        assert srv.wait_idle(s, 30) == (0, 0), f"{s.name} still holds KV blocks or requests"
