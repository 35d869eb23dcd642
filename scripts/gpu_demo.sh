#!/usr/bin/env bash
# `kvpush demo` (two processes over NIXL) on the GPU machine, whose CPUs are otherwise idle: the
# host-memory runs of docs/benchmarks.md (pinned to 2 cores with taskset: the demo's run-keeping
# allocator and vLLM-like FIFO pools, staging off and on, NIXL with two UCX threads). (The demo with
# its caches in GPU memory, KVPUSH_DEVICE=cuda:0, in one process and in two: scripts/gpu_check.sh.)
# Everything comes from the carried
# directory that `scripts/gpu_bench.sh --prepare` fills (plus a release `kvpush` binary copied there).
#
#   scripts/gpu_demo.sh                # on the GPU machine; results and logs in $OUT (default target/gpu-demo)
#
# Environment: KVPUSH_GPU_DIR (default .cache/gpu), OUT, KVPUSH_DEMO_RUNS (space-separated run names
# to play, default all of them: see `runs` below), KVPUSH_DEMO_LIMIT_S (per run, default 100).
# Issue #22 item 3, FIFO pools unstaged against the default (auto: measured per WRITE), interleaved:
#   KVPUSH_DEMO_RUNS="fifo-off-1 fifo-auto-1 fifo-off-2 fifo-auto-2 fifo-off-3 fifo-auto-3 runs-auto" scripts/gpu_demo.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
G="${KVPUSH_GPU_DIR:-.cache/gpu}"
OUT="${OUT:-$PWD/target/gpu-demo}"
mkdir -p "$OUT"
for f in kvpush nixl-cu13.tar.xz; do
  [ -e "$G/$f" ] || { echo "missing $G/$f: run scripts/gpu_bench.sh --prepare and copy target/release/kvpush there" >&2; exit 2; }
done
W="$(mktemp -d /tmp/kvpush-demo.XXXXXX)"
tar -C "$W" -xJf "$G/nixl-cu13.tar.xz"
export NIXL_PLUGIN_DIR="$W/nixl-cu13/lib/plugins"
export LD_LIBRARY_PATH="$W/nixl-cu13/lib:$W/nixl-cu13/deps:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVPUSH_CUDA_PTX="$PWD/$G/kernels.ptx"
{ lscpu | grep -E "Model name|^CPU\(s\)"; uptime; } | tee "$OUT/machine.txt"

# name | environment | command arguments
runs() {
  cat <<'EOF'
host-runs-a|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --allocator runs
host-runs-b|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --allocator runs
host-runs-c|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --allocator runs
host-fifo|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --allocator fifo
host-runs-threads2|KVPUSH_DEVICE=host KVPUSH_NIXL_PARAMS=num_threads=2|taskset -c 0,1 KVPUSH --allocator runs
host-off-a|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --staging off --allocator fifo
host-on1m-a|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --staging on --staging-slot-kib 1024 --allocator fifo
host-on8m-a|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --staging on --staging-slot-kib 8192 --allocator fifo
host-off-b|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --staging off --allocator fifo
host-on1m-b|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --staging on --staging-slot-kib 1024 --allocator fifo
host-threads2|KVPUSH_DEVICE=host KVPUSH_NIXL_PARAMS=num_threads=2|taskset -c 0,1 KVPUSH --staging off --allocator fifo
fifo-off-1|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --staging off --allocator fifo
fifo-auto-1|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --allocator fifo
fifo-off-2|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --staging off --allocator fifo
fifo-auto-2|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --allocator fifo
fifo-off-3|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --staging off --allocator fifo
fifo-auto-3|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --allocator fifo
runs-auto|KVPUSH_DEVICE=host|taskset -c 0,1 KVPUSH --allocator runs
EOF
}

want="${KVPUSH_DEMO_RUNS:-}"
while IFS='|' read -r name envs cmd; do
  [ -n "$want" ] && [[ " $want " != *" $name "* ]] && continue
  cmd="${cmd/KVPUSH/$G/kvpush demo --transport nixl --processes 2 --mode push}"
  echo "== $name: $envs $cmd"
  # shellcheck disable=SC2086 # the environment and command words are meant to split
  env $envs timeout "${KVPUSH_DEMO_LIMIT_S:-100}" $cmd --quiet --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "$name: exit $?"
done < <(runs)

python3 - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    p = json.load(open(f)).get("push") or {}
    c, g = p.get("ceiling_gbps"), p.get("push_gbps")
    r = lambda v: [round(x, 2) for x in v or []]
    print(os.path.basename(f)[:-5], "failed", p.get("failed"), "ceiling", round(c or 0, 2), "push", round(g or 0, 2),
          "ratio", round(g / c, 3) if c and g else None, "push rounds", r(p.get("push_gbps_rounds")),
          "ceiling rounds", r(p.get("ceiling_gbps_rounds")), "descriptors", p.get("push_descriptors_rounds"),
          "pieces", p.get("push_pieces_rounds"))
PY
