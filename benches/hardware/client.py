#!/usr/bin/env python3
"""The hardware bench kit's client: the push-vs-pull sweep against servers someone else started.

benches/vllm_pd.py starts its own CPU servers; on trn1/trn2 and p5en the kit's shell scripts start P and
D on two hosts and ``kvpush router`` on the driver (benches/hardware/sweep.sh), and this client only
talks to the router (``--router-url``). It reuses vllm_pd's request loop (``run_cell``: Poisson
arrivals, streaming greedy completions, TTFT and TPOT per request), its summary (``summarize``: p50/p99)
and its plot (``plot``), and writes the same JSON schema, so ``vllm_pd.py --plot`` and
``client.py plot`` draw either file.

One JSON per run: ``run`` appends one setup (its connector configs, warm-up, one cell per request rate
and input length, every request) to ``--out``, creating the file with the run's parameters on the
first call, and rewrites it after every cell, so an interrupted run keeps what it measured.

    client.py check                                   # the driver's Python has what the kit needs
    client.py run --router-url http://127.0.0.1:8000 --out RUN.json --setup kvpush-push --mode push \\
        --model Qwen/Qwen3-32B --lengths 1024,2048,4096,8192,16384 --rates 1,2,4,8 --max-tokens 128
    client.py run --out RUN.json --setup vllm-pull --mode pull --error "P did not start"  # record a failure
    client.py plot RUN.json                           # RUN.png: TTFT and TPOT (p50, p99) vs input length

Prompts are token ids, uniform over the model's ordinary vocabulary (``--vocab-size``: Qwen3's
ordinary tokens are ids 0-151642; 151643 and above are special), fresh for every request, so no two
share a prefix and prefix caching cannot stand in for a transfer. The same seeds are used for every
setup, so all setups see the same prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benches"))


def _bench() -> Any:
    """benches/vllm_pd.py (imported on first use: it needs requests, which ``check`` reports on)."""
    import vllm_pd  # puts tests/python on sys.path: servers, tiny_model

    return vllm_pd

QWEN3_ORDINARY_VOCAB = 151643


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def plot_title(meta: dict[str, Any], model: str) -> str:
    """The first part of the plot's title: what ran where (the hosts are in the JSON)."""
    parts = [model]
    for key, fmt in (("tp", "TP {}"), ("platform", "{}"), ("nixl_backend", "NIXL {}")):
        if meta.get(key):
            parts.append(fmt.format(meta[key]))
    return "P/D behind kvpush router, " + ", ".join(parts)


def new_result(args: argparse.Namespace, meta: dict[str, Any]) -> dict[str, Any]:
    """The run's header: vllm_pd's schema, with the hardware description under "hardware"."""
    return {
        "bench": "hardware_pd",
        "command": meta.get("command") or " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "started_at": _now(),
        "params": {"lengths": _ints(args.lengths), "rates": _floats(args.rates), "requests_per_cell": args.requests,
                   "max_tokens": args.max_tokens, "streaming": True, "greedy": True, "arrivals": "poisson",
                   "logprobs": not args.no_logprobs, "model": args.model,
                   "prompts": f"token ids uniform over [4, {args.vocab_size}), fresh per request"},  # fmt: skip
        "versions": _bench().versions(),
        "machine": _bench().machine(),  # the driver, where the client and the router run
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "hardware": meta,
        "plot_title": plot_title(meta, args.model),
        "setups": [],
    }


def cmd_check(_: argparse.Namespace) -> int:
    missing = []
    for mod in ("requests", "matplotlib"):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001
            missing.append(f"{mod} ({e})")
    if missing:
        print(f"FAIL  driver: {sys.executable} lacks {', '.join(missing)}: pip install requests matplotlib "
              "(or pass --local-python)")  # fmt: skip
        return 1
    try:
        _bench()
    except Exception as e:  # noqa: BLE001
        print(f"FAIL  driver: benches/vllm_pd.py does not import: {e!r}")
        return 1
    print(f"ok    driver: {sys.executable} has requests and matplotlib; benches/vllm_pd.py imports")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    print(_bench().plot(args.file))
    return 0


def _warm_up(args: argparse.Namespace, entry: dict[str, Any]) -> bool:
    """Sends warm-up requests until two in a row succeed (first handshakes, first compilations)."""
    bench = _bench()
    extra = {"model": args.model}
    prompts = bench.tiny_model.make_prompts([args.warmup_tokens] * (2 * args.warmup_tries), seed=999,
                                      vocab_size=args.vocab_size)  # fmt: skip
    entry["warmup"] = []
    streak = 0
    for p in prompts:
        t = time.monotonic()
        try:
            bench.srv.complete(args.router_url, p, 8, logprobs=not args.no_logprobs, stream=True, extra=extra,
                         timeout_s=args.warmup_timeout_s)  # fmt: skip
            entry["warmup"].append({"ok": True, "s": round(time.monotonic() - t, 2)})
            streak += 1
        except Exception as e:  # noqa: BLE001
            entry["warmup"].append({"ok": False, "s": round(time.monotonic() - t, 2), "error": str(e)[:300]})
            print(f"[{args.setup}] warm-up request failed: {str(e)[:200]}", flush=True)
            streak = 0
        if streak == 2:
            print(f"[{args.setup}] warm-up: {entry['warmup']}", flush=True)
            return True
    return False


def cmd_run(args: argparse.Namespace) -> int:
    meta = json.loads(args.meta) if args.meta else {}
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(out.read_text()) if out.exists() else new_result(args, meta)
    entry: dict[str, Any] = {
        "name": args.setup, "description": args.description or args.setup, "mode": args.mode,
        "p_kv_transfer_config": json.loads(args.p_config) if args.p_config else None,
        "d_kv_transfer_config": json.loads(args.d_config) if args.d_config else None,
        "servers": {"P": {"env": args.p_env}, "D": {"env": args.d_env}},
        "router_url": args.router_url, "started_at": _now(),
    }  # fmt: skip
    result["setups"].append(entry)
    t0 = time.monotonic()

    def save() -> None:
        entry["wall_s"] = round(time.monotonic() - t0, 1)
        result["finished_at"] = _now()
        result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        _write(out, result)

    if args.error:
        entry["error"] = args.error
        save()
        print(f"[{args.setup}] recorded as failed: {args.error}", flush=True)
        return 0
    if not args.router_url:
        print("client.py run: --router-url is required (or --error to record a failed setup)", file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: Any) -> None:
        # The sweep's trap stops us while requests are in flight: keep what was measured, and do not
        # wait for the request threads (they would hold the exit for up to their timeout).
        entry["error"] = f"interrupted by signal {signum}"
        try:
            save()
        finally:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    entry["incomplete"] = True
    save()
    if not _warm_up(args, entry):
        entry["error"] = f"warm-up: no two requests in a row succeeded in {len(entry['warmup'])} tries"
        entry.pop("incomplete", None)
        save()
        print(f"[{args.setup}] FAILED: {entry['error']}", flush=True)
        return 1
    bench = _bench()
    entry["cells"] = []
    save()  # measuring from here on
    lengths, rates = _ints(args.lengths), _floats(args.rates)
    fmt = lambda x: "-" if x is None else f"{x * 1000:.0f}"  # noqa: E731
    for ri, rate in enumerate(rates):
        for li, length in enumerate(lengths):
            seed = 1000 + ri * 100 + li  # the same prompts for every setup
            prompts = bench.tiny_model.make_prompts([length] * args.requests, seed=seed, vocab_size=args.vocab_size)
            la0, w0 = os.getloadavg()[0], time.monotonic()
            records = bench.run_cell(args.router_url, prompts, rate, args.max_tokens, seed,
                                       extra={"model": args.model}, logprobs=not args.no_logprobs)  # fmt: skip
            cell = {"rate_qps": rate, "input_tokens": length, "wall_s": round(time.monotonic() - w0, 2),
                    "load_average_1m": [round(la0, 2), round(os.getloadavg()[0], 2)],
                    **bench.summarize(records), "records": records}  # fmt: skip
            entry["cells"].append(cell)
            save()
            print(
                f"[{args.setup}] {rate:g} QPS, {length:5d} tokens: ok {cell['ok']}/{cell['requests']}, "
                f"TTFT p50/p99 {fmt(cell['ttft_p50_s'])}/{fmt(cell['ttft_p99_s'])} ms, "
                f"TPOT p50/p99 {fmt(cell['tpot_p50_s'])}/{fmt(cell['tpot_p99_s'])} ms",
                flush=True,
            )
    entry.pop("incomplete", None)
    save()
    failed = sum(c["requests"] - c["ok"] for c in entry["cells"])
    print(f"[{args.setup}] done: {failed} failed request(s); {out}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="the driver's Python has requests and matplotlib")
    p = sub.add_parser("plot", help="draw RUN.png from RUN.json (benches/vllm_pd.py's plot)")
    p.add_argument("file", type=Path)
    r = sub.add_parser("run", help="measure one setup through a running router; append it to --out")
    r.add_argument("--router-url", default="", help="the router in front of P and D, e.g. http://127.0.0.1:8000")
    r.add_argument("--out", type=Path, required=True, help="the run's JSON (created on the first setup)")
    r.add_argument("--setup", required=True, help="the setup's name, e.g. kvpush-push")
    r.add_argument("--mode", required=True, choices=("push", "pull"), help="the router's mode")
    r.add_argument("--description", default="")
    r.add_argument("--p-config", default="", help="P's --kv-transfer-config (JSON), recorded")
    r.add_argument("--d-config", default="", help="D's --kv-transfer-config (JSON), recorded")
    r.add_argument("--p-env", action="append", default=[], help="P's extra environment K=V, recorded")
    r.add_argument("--d-env", action="append", default=[], help="D's extra environment K=V, recorded")
    r.add_argument("--meta", default="", help="JSON describing the hardware run (stored under 'hardware')")
    r.add_argument("--model", default="Qwen/Qwen3-32B", help="the served model name sent in every request")
    r.add_argument("--vocab-size", type=int, default=QWEN3_ORDINARY_VOCAB,
                   help="prompt token ids are drawn from [4, this)")  # fmt: skip
    r.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="input lengths, tokens")
    r.add_argument("--rates", default="1,2,4,8", help="request rates, requests per second")
    r.add_argument("--requests", type=int, default=64, help="requests per (rate, length) cell")
    r.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    r.add_argument("--no-logprobs", action="store_true",
                   help="do not ask for logprobs (tokens are then timed by their text chunks)")  # fmt: skip
    r.add_argument("--warmup-tokens", type=int, default=1024, help="input length of the warm-up requests")
    r.add_argument("--warmup-tries", type=int, default=3, help="warm-up rounds of two requests, at most")
    r.add_argument("--warmup-timeout-s", type=float, default=900.0, help="timeout of one warm-up request")
    r.add_argument("--error", default="", help="record the setup as failed with this message; send nothing")
    args = ap.parse_args(argv)
    return {"check": cmd_check, "plot": cmd_plot, "run": cmd_run}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
