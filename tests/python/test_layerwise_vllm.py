"""Layer-wise push driven by vLLM's hooks (issue 21), on real vLLM CPU servers behind ``kvpush router``.

P runs with ``layerwise: on`` and chunked prefill in 256-token steps (``--max-num-batched-tokens
256``), so prompts above 256 tokens are computed over several steps and go with their last chunk only;
D is an ordinary kvpush consumer. Checked against one vLLM engine alone (same tiny seeded model,
float32, greedy, logprobs; ``servers.assert_same_output``):

- every prompt's tokens and logprobs equal, sequentially and with 8 concurrent clients;
- D computed no prompt token beyond the last of each request (vLLM's prompt-tokens-by-source);
- P's engine was told layer by layer: its timeline (``KVPUSH_TIMELINE``) has one ``eng_layers_ready``
  per layer of the model for every transfer, and P's transfers outnumber its requests (layers posted
  apart; vLLM's ``vllm:kvpush_xfer_time_seconds_count``);
- nothing is left held on either server afterwards.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import servers as srv
import tiny_model

LENGTHS = [30, 64, 128, 200, 256, 300, 450, 517, 640, 777, 900]
MAX_TOKENS = 8
PROMPTS = tiny_model.make_prompts(LENGTHS, seed=21)
LAYERS = tiny_model.TinyLlama().num_hidden_layers


@pytest.fixture(scope="module")
def reference(servers: "object", vllm_ready: str) -> list[srv.Completion]:
    return srv.outputs_alone(servers, "lw-single", PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def layerwise_pair(servers: "object", reference: list[srv.Completion], tmp_path_factory: pytest.TempPathFactory):
    env = {
        "KVPUSH_TIMELINE": str(tmp_path_factory.mktemp("timeline-lw")),
        "KVPUSH_LOG": os.environ.get("KVPUSH_TEST_LOG", "info"),
    }
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(
            servers.vllm,
            "lw-P",
            kv_transfer_config=functools.partial(srv.kvpush_config, "prefill", "push", "lw-prefill", layerwise="on"),
            extra_env=env,
            extra_args=["--max-num-batched-tokens", "256"],
        )
        d = pool.submit(
            servers.vllm,
            "lw-D",
            kv_transfer_config=functools.partial(srv.kvpush_config, "decode", "push", "lw-decode"),
            extra_env=env,
        )
        p, d = p.result(), d.result()
    router = servers.router("push", [p], [d], name="router-lw", extra_env=env)
    yield p, d, router
    for s in (router, d, p):
        servers.stop(s)


def layer_reports(folder: str) -> Counter[str]:
    """``eng_layers_ready`` events per transfer id in the engines' timelines under ``folder``."""
    out: Counter[str] = Counter()
    for path in Path(folder).glob("engine-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("ev") == "eng_layers_ready":
                out[str(e["tid"])] += 1
    return out


def transfers(server: srv.VllmServer) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("vllm:kvpush_xfer_time_seconds_count"))


def test_layerwise_push_matches_one_engine_and_goes_layer_by_layer(layerwise_pair, reference) -> None:
    p, d, router = layerwise_pair
    folder = p.env["KVPUSH_TIMELINE"]
    before_reports = layer_reports(folder)
    before_src, before_xfers = d.prompt_tokens_by_source(), transfers(p)
    for i, (n, ref) in enumerate(zip(LENGTHS, reference)):
        got = srv.complete(router.url, PROMPTS[i], MAX_TOKENS, stream=(i % 2 == 1))
        srv.assert_same_output(got, ref, f"layer-wise push, {n}-token prompt")
    after = d.prompt_tokens_by_source()
    delta = {k: after.get(k, 0) - before_src.get(k, 0) for k in after}
    reports = layer_reports(folder) - before_reports
    xfers = transfers(p) - before_xfers
    print(
        f"\nlayer-wise push: {len(PROMPTS)} prompts equal; D's prompt tokens by source {delta}; "
        f"layer reports per transfer {sorted(reports.values())}; P's transfers {xfers:.0f}"
    )
    assert delta.get("local_compute", 0) <= len(PROMPTS), delta
    assert delta.get("external_kv_transfer", 0) >= sum(LENGTHS) - len(PROMPTS), delta
    # Every transfer was reported to the engine layer by layer, once per layer (the hooks, not
    # wait_for_save's whole-request path, which would leave no eng_layers_ready).
    assert len(reports) == len(PROMPTS), reports
    assert set(reports.values()) == {LAYERS}, reports
    # Posted apart: more transfers than requests (D registers before P's prefill ends, as the router
    # sends both legs at once; a request whose registration came late goes in one batch).
    assert xfers > len(PROMPTS), xfers


def test_layerwise_push_eight_concurrent_clients(layerwise_pair, reference) -> None:
    p, d, router = layerwise_pair
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: srv.complete(router.url, PROMPTS[i], MAX_TOKENS), range(len(PROMPTS))))
    for n, got, ref in zip(LENGTHS, outs, reference):
        srv.assert_same_output(got, ref, f"layer-wise push, 8 clients, {n}-token prompt")
    assert srv.wait_idle(p) == (0, 0) and srv.wait_idle(d) == (0, 0)
