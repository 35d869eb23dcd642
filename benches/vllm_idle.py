"""What a decode server that waits for its KV takes from the CPU beside it (issue 18, docs/benchmarks.md).

In push mode D gets its request while P is still computing the prompt, and waits for the KV. vLLM steps
such a D about once a millisecond (each step a round trip to its worker process, whose shared-memory
reader spins between steps); on a 2-core machine that CPU comes out of P's prefill. This starts a kvpush
push pair (real vLLM CPU servers, the tiny model), stops P with SIGSTOP so the KV never comes, sends D a
request, and runs two CPU-bound Python loops (a stand-in for P) for ``--seconds``: once with D idle, once
with D waiting. It prints D's CPU use and the loops' iterations per second in both states, for each
``--idle-wait-ms`` value (the connector's setting; 0 is off), in the order given, and for each of D's
vLLM executors in ``--d-executor`` (``mp``, vLLM's CPU default, the worker in a process of its own;
``uni``, the worker inside the engine-core process: servers.EXECUTORS).

    . scripts/nixl.sh && . scripts/python.sh && maturin develop --release
    python benches/vllm_idle.py --idle-wait-ms 4,0,4,0
    python benches/vllm_idle.py --idle-wait-ms 4,4 --d-executor mp,uni
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "benches"))

import servers as srv  # noqa: E402
import tiny_model  # noqa: E402
from vllm_pd import kvpush_config  # noqa: E402

LOOP = "import time\nn = 0\nend = time.monotonic() + {secs}\nwhile time.monotonic() < end:\n    n += 1\nprint(n)"


def loops_per_s(secs: float, n: int = 2) -> float:
    """``n`` CPU-bound processes for ``secs``: their iterations per second, summed."""
    procs = [subprocess.Popen([sys.executable, "-c", LOOP.format(secs=secs)], stdout=subprocess.PIPE) for _ in range(n)]
    return sum(int(p.communicate()[0]) for p in procs) / secs


def measure(model_dir: Path, idle_wait_ms: float, secs: float, executor: str = "mp") -> dict[str, Any]:
    ports = srv.free_ports(2)
    cfg = {r: kvpush_config(r, "push", f"idle-{r}", {"idle_wait_ms": idle_wait_ms}) for r in ("prefill", "decode")}
    cfg["prefill"]["kv_connector_extra_config"]["side_channel_port"] = ports[0]
    cfg["decode"]["kv_connector_extra_config"].update(side_channel_port=ports[1], timeout_ms=120_000)
    p = srv.start_vllm("idle-P", model_dir, kv_transfer_config=cfg["prefill"], side_channel_port=ports[0])
    d_env, d_args = srv.EXECUTORS[executor]
    d = srv.start_vllm("idle-D", model_dir, kv_transfer_config=cfg["decode"], side_channel_port=ports[1],
                       extra_env=d_env, extra_args=d_args)  # fmt: skip
    try:
        time.sleep(3)  # past the warm-up's spinning (vLLM's reader spins 1 s after its last read)
        c0, t0 = srv.group_cpu_seconds(d), time.monotonic()
        idle = loops_per_s(secs)
        d_idle = (srv.group_cpu_seconds(d) - c0) / (time.monotonic() - t0)
        os.killpg(p.proc.pid, signal.SIGSTOP)
        params = srv.consumer_params(p, "idle-bench-transfer")

        def send() -> None:
            try:
                srv.complete(d.url, list(range(5, 200)), max_tokens=2, timeout_s=300, extra={"kv_transfer_params": params})
            except Exception:  # noqa: BLE001 - P never answers; the servers are stopped under it
                pass

        threading.Thread(target=send, daemon=True).start()
        time.sleep(2)
        c0, t0 = srv.group_cpu_seconds(d), time.monotonic()
        waiting = loops_per_s(secs)
        d_waiting = (srv.group_cpu_seconds(d) - c0) / (time.monotonic() - t0)
    finally:
        os.killpg(p.proc.pid, signal.SIGCONT)
        p.stop()
        d.stop()
    return {
        "idle_wait_ms": idle_wait_ms,
        "d_executor": executor,
        "d_cores_idle": round(d_idle, 3),
        "d_cores_waiting": round(d_waiting, 3),
        "loops_per_s_d_idle": idle,
        "loops_per_s_d_waiting": waiting,
        "loops_share_left": round(waiting / idle, 3),
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle-wait-ms", default="4,0", help="connector idle_wait_ms values, run in this order")
    ap.add_argument("--d-executor", default="mp", help="D's vLLM executors, comma-separated: mp (vLLM's CPU default), uni")
    ap.add_argument("--seconds", type=float, default=5.0, help="how long the loops run in each state")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    model_dir = tiny_model.model_dir()
    rows = []
    executors = args.d_executor.split(",")
    if unknown := [e for e in executors if e not in srv.EXECUTORS]:
        ap.error(f"--d-executor: unknown {unknown}; known: {sorted(srv.EXECUTORS)}")
    for v, ex in ((float(x), ex) for x in args.idle_wait_ms.split(",") for ex in executors):
        row = measure(model_dir, v, args.seconds, ex)
        rows.append(row)
        print(
            f"idle_wait_ms {v:g}, D executor {ex}: D idle {100 * row['d_cores_idle']:.1f} % of a core, waiting "
            f"{100 * row['d_cores_waiting']:.1f} %; the loops keep {row['loops_share_left']:.2f} of their "
            f"idle rate ({row['loops_per_s_d_waiting']:.3g} vs {row['loops_per_s_d_idle']:.3g} it/s); "
            f"load {row['load_average']:.1f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"bench": "vllm_idle", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
