#!/usr/bin/env bash
# Session 13 on one H200: the layer-wise stage split with P's GPU idle (sleeps) and busy
# (--prefill-gpu-busy), interleaved, then the GPU check's test binaries and connector layouts.
set -uo pipefail
C="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
exec > >(tee -a "$OUT/s13.log") 2>&1
. "$C/gpu_env.sh"
W="$(mktemp -d /tmp/kvpush-s13.XXXXXX)"
tar -C "$W" -xJf "$C/bin.tar.xz"
unpack_nixl "$C/nixl-cu13.tar.xz" "$W"
export KVPUSH_CUDA_PTX="$C/kernels.ptx"
add_cuda_libs "$KVPUSH_CUDA_PTX"
K="$W/bin/kvpush"
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
lw() { # name, per-layer µs, extra args
  local name=$1 us=$2; shift 2
  echo "== $name ($(date -u +%T))"
  KVPUSH_DEVICE=cuda:0 timeout 120 "$K" demo --transport nixl --processes 2 --mode push --requests 10 \
    --min-tokens 16384 --max-tokens 16384 --layerwise compare --layerwise-engine on --registration-first \
    --prefill-us-per-layer "$us" --quiet --json "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2>&1
  echo "exit $?"; tail -4 "$OUT/$name.txt"
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
    l = json.load(open(sys.argv[1]))["layerwise"]
except Exception as e:
    print("no JSON:", e); sys.exit()
s, w = l.get("stages") or {}, l.get("whole_stages") or {}
p50 = lambda d: {k[:-4]: v for k, v in d.items() if k.endswith("_p50")}
print("exposed p50/p99 %s/%s whole %s/%s ratio_p50 %s" % (l["exposed_us_p50"], l["exposed_us_p99"],
      l["whole_exposed_us_p50"], l["whole_exposed_us_p99"], l["ratio_p50"]))
print("stages", p50(s)); print("whole_stages", p50(w))
PY
}
for round in 1 2; do
  lw "lw30-idle-r$round" 30000
  lw "lw30-busy-r$round" 30000 --prefill-gpu-busy
  lw "lw5-idle-r$round" 5000
  lw "lw5-busy-r$round" 5000 --prefill-gpu-busy
done
# The error path: --prefill-gpu-busy on host memory must fail with a clear message.
KVPUSH_DEVICE=host timeout 60 "$K" demo --transport nixl --processes 2 --mode push --requests 2 \
  --prefill-us-per-layer 1000 --layerwise on --prefill-gpu-busy --quiet > "$OUT/busy-host.txt" 2>&1
echo "busy on host: exit $? ($(grep -m1 -o "gpu-busy[^\"]*" "$OUT/busy-host.txt"))"
echo "== the GPU check: test binaries and connector layouts ($(date -u +%T))"
OUT="$OUT/check" KVPUSH_CHECK_DEMOS=0 KVPUSH_CHECK_BUDGET_S=330 bash "$C/gpu_check.sh" > /dev/null 2>&1
cat "$OUT/check/summary.txt"
date -u
