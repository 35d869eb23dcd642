#!/usr/bin/env bash
# Everything kvpush does on a GPU, in one run on a machine with one NVIDIA GPU, no Rust toolchain and
# no network (the H200): the test binaries that touch devices, then the demo matrix on GPU memory
# (one process over the loopback transport, two processes over NIXL; staging auto/on/off; run and
# FIFO block pools; the default 200 requests, every byte verified), then the vLLM connector's worker
# half on CUDA tensors laid out as each attention backend lays them out (benches/connector_layouts.py,
# from the kvpush wheel; torch must be installed there, vLLM need not be). Built and collected here,
# carried, run there.
#
#   scripts/gpu_check.sh --prepare [DIR]   # on a build machine (cargo, network): fills DIR (default
#                                          # .gpu-carry) with this script, gpu_env.sh, bin.tar.xz (release kvpush
#                                          # and the test binaries: lib, cuda, device, transport,
#                                          # engine, proto), the abi3 kvpush wheel (maturin build
#                                          # --release, in .cache/venv) with connector_layouts.py, and
#                                          # from .cache/gpu (scripts/gpu_bench.sh --prepare, run if
#                                          # missing) nixl-cu13.tar.xz and kernels.ptx
#   bash DIR/gpu_check.sh                  # on the GPU machine: unpacks, records the machine, runs the
#                                          # tests and the demos, prints a summary. $OUT (default
#                                          # target/gpu-check) gets four files: gpu_check.log, summary.txt,
#                                          # machine.txt and results.tar.gz (each test binary's output,
#                                          # each demo's table and JSON, the layouts' table and JSON).
#
# Environment (run step): OUT, KVPUSH_CHECK_DEMOS=0 (no demos), KVPUSH_CHECK_TESTS=0 (no test binaries),
# KVPUSH_CHECK_LAYOUTS=0 (no connector layouts), KVPUSH_CHECK_LAYOUTS_S (its limit, default 180 s, kept
# out of the demos' budget; it starts no case after three quarters of it), KVPUSH_CHECK_LAYOUTS_ARGS (more arguments for connector_layouts.py),
# KVPUSH_CHECK_REQUESTS (default 200), KVPUSH_CHECK_LIMIT_S (per demo, default 90), KVPUSH_CHECK_BUDGET_S
# (the whole run, default 560: demos left when it runs out are reported as skipped), KVPUSH_CHECK_EXTRA
# (more two-process push demos after the matrix: "name:args;name:args", e.g.
# "slots16:--staging on --allocator fifo --staging-slots 16").
set -uo pipefail

prepare() {
  set -e
  local root dir stage
  root="$(cd "$(dirname "$0")/.." && pwd)"
  cd "$root"
  dir="${1:-.gpu-carry}"
  local g=.cache/gpu
  if [ ! -e "$g/nixl-cu13.tar.xz" ] || [ ! -e "$g/kernels.ptx" ]; then
    scripts/gpu_bench.sh --prepare
  fi
  # shellcheck source=scripts/nixl.sh
  . scripts/nixl.sh
  cargo build --release --bin kvpush
  stage="$(mktemp -d)"
  mkdir -p "$stage/bin/tests"
  cp target/release/kvpush "$stage/bin/kvpush"
  cargo test --release --no-run --lib --test cuda --test device --test transport --test engine --test proto \
    --message-format=json 2>/dev/null | python3 -c '
import json, sys, shutil
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m.get("profile", {}).get("test"):
        continue
    lib = {"lib", "rlib", "cdylib"} & set(m["target"]["kind"])
    name = "lib" if lib else m["target"]["name"]
    shutil.copy(m["executable"], sys.argv[1] + "/" + name)
    print("test binary:", name)
' "$stage/bin/tests"
  mkdir -p "$dir"
  tar -C "$stage" -cJf "$dir/bin.tar.xz" bin
  rm -rf "$stage"
  cp "$g/nixl-cu13.tar.xz" "$g/kernels.ptx" "$dir/"
  cp scripts/gpu_check.sh scripts/gpu_env.sh benches/connector_layouts.py "$dir/"
  # The kvpush wheel (abi3: any CPython >= 3.10 there) for the connector layouts run.
  rm -f "$dir"/kvpush-*.whl
  # shellcheck source=scripts/python.sh
  . scripts/python.sh
  maturin build --release --quiet --out "$dir"
  ls -la "$dir"
  du -sh "$dir"
}

if [ "${1:-}" = "--prepare" ]; then
  shift
  prepare "$@"
  exit
fi

# ---- on the GPU machine ----
C="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=scripts/gpu_env.sh
. "$C/gpu_env.sh"
for f in bin.tar.xz nixl-cu13.tar.xz kernels.ptx; do
  [ -e "$C/$f" ] || { echo "missing $C/$f: run scripts/gpu_check.sh --prepare on a build machine and carry it" >&2; exit 2; }
done
OUT="${OUT:-$PWD/target/gpu-check}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
# Every output but the log, the summary and the machine goes to R, packed into results.tar.gz at the
# end (the device tool brings back a few files only).
R="$(mktemp -d /tmp/kvpush-results.XXXXXX)"
started=$(date +%s)
budget=${KVPUSH_CHECK_BUDGET_S:-560}
elapsed() { echo $(( $(date +%s) - started )); }
step() { printf '\n==> %s (%ss)\n' "$*" "$(elapsed)"; }
# Keep NVLink multicast off (shared machines: see the device docs).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

step "unpacking NIXL for CUDA 13 and the binaries"
W="$(mktemp -d /tmp/kvpush-check.XXXXXX)"
tar -C "$W" -xJf "$C/bin.tar.xz"
unpack_nixl "$C/nixl-cu13.tar.xz" "$W"
export KVPUSH_CUDA_PTX="$C/kernels.ptx"
add_cuda_libs "$KVPUSH_CUDA_PTX"
KVPUSH="$W/bin/kvpush"

step "machine"
{
  date -u
  uname -r
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  nproc
  ldd "$KVPUSH" | grep -E "not found" || true
} 2>&1 | tee "$OUT/machine.txt"

summary="$OUT/summary.txt"
: > "$summary"

if [ "${KVPUSH_CHECK_TESTS:-1}" = 1 ]; then
  # lib: the library's unit tests; cuda, device: the device layer (the CUDA ones run on device 0);
  # transport: the loopback (GPU memory copied through the device) and NIXL; engine: every TP pairing
  # through the demo's engines on the device `auto` picks, the GPU here (CI runs it on host memory),
  # the stress and side-channel tests; proto: the protocol core (no device, as a control).
  for t in lib cuda device transport engine proto; do
    step "tests: $t"
    (cd "$W" && timeout 150 "$W/bin/tests/$t" 2>&1) > "$R/test-$t.txt"
    rc=$?
    grep -E "^test .*(FAILED|ok)$|test result|panicked|not run" "$R/test-$t.txt" | grep -vE " ok$" | tail -15
    line="$(grep -E "^test result" "$R/test-$t.txt" | tail -1)"
    printf 'tests %-14s exit %3s  %s\n' "$t" "$rc" "${line:-no result line (see test-$t.txt)}" >> "$summary"
  done
fi

if [ "${KVPUSH_CHECK_DEMOS:-1}" = 1 ]; then
  requests=${KVPUSH_CHECK_REQUESTS:-200}
  limit=${KVPUSH_CHECK_LIMIT_S:-90}
  # The connector layouts run after the demos: its time is kept out of theirs.
  demo_budget=$budget
  [ "${KVPUSH_CHECK_LAYOUTS:-1}" = 1 ] && demo_budget=$(( budget - ${KVPUSH_CHECK_LAYOUTS_S:-180} ))
  runs=()
  for procs in 1 2; do
    for staging in auto on off; do
      for alloc in runs fifo; do
        a="--staging $staging --allocator $alloc"
        [ "$procs" = 2 ] && a+=" --transport nixl --processes 2 --mode push"
        runs+=("demo-${procs}p-$staging-$alloc:$a")
      done
    done
  done
  IFS=';' read -r -a extra <<< "${KVPUSH_CHECK_EXTRA:-}"
  for e in "${extra[@]}"; do
    [ -n "$e" ] && runs+=("extra-${e%%:*}:${e#*:} --transport nixl --processes 2 --mode push")
  done
  for run in "${runs[@]}"; do
    name="${run%%:*}"
    if [ $(( $(elapsed) + limit )) -gt "$demo_budget" ]; then
      printf '%-24s skipped: the demo budget (%ss) is spent\n' "$name" "$demo_budget" >> "$summary"
      continue
    fi
    # shellcheck disable=SC2206 # the arguments are meant to split
    args=(demo --requests "$requests" ${run#*:} --quiet --json "$R/$name.json")
    step "$name: KVPUSH_DEVICE=cuda:0 kvpush ${args[*]}"
    t0=$(date +%s.%N)
    KVPUSH_DEVICE=cuda:0 timeout "$limit" "$KVPUSH" "${args[@]}" > "$R/$name.txt" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    tail -25 "$R/$name.txt"
    python3 - "$R/$name.json" "$name" "$rc" "$t0" "$t1" >> "$summary" <<'PY'
import json, sys
path, name, rc, t0, t1 = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
try:
    d = json.load(open(path))
except Exception:
    d = {}
parts = []
for mode in ("push", "pull"):
    m = d.get(mode)
    if not m:
        continue
    ok = m["failed"] == 0 and m["verified_bytes"] == m["bytes"] and m["requests"] > 0
    s = "%s %d req, failed %d, %s, wall %.2f s, %.2f GB/s" % (
        mode, m["requests"], m["failed"], "all verified" if ok else "NOT ALL VERIFIED", m["wall_s"], m["gbps"])
    if m.get("push_gbps") is not None and m.get("ceiling_gbps"):
        s += ", push %.1f GB/s of ceiling %.1f (%.1f %%), rounds %s, descriptors %s, pieces %s" % (
            m["push_gbps"], m["ceiling_gbps"], 100 * m["push_gbps"] / m["ceiling_gbps"],
            [round(x, 1) for x in m.get("push_gbps_rounds", [])], m.get("push_descriptors_rounds"),
            m.get("push_pieces_rounds"))
    parts.append(s)
print("%-24s exit %3d  process %5.1f s  %s" % (name, rc, t1 - t0, "; ".join(parts) or "no JSON"))
PY
  done
fi

if [ "${KVPUSH_CHECK_LAYOUTS:-1}" = 1 ]; then
  # The connector's worker half (python/kvpush/vllm.py) driven without vLLM on CUDA tensors of every
  # backend layout, P and D as two processes, kv_buffer_device cuda and cpu (host mirror), push and pull.
  name=connector-layouts
  llimit=${KVPUSH_CHECK_LAYOUTS_S:-180}
  whl="$(find "$C" -maxdepth 1 -name "kvpush-*.whl" | head -1)"
  if [ -z "$whl" ] || [ ! -e "$C/connector_layouts.py" ]; then
    printf '%-24s not run: no kvpush wheel or connector_layouts.py in %s\n' "$name" "$C" >> "$summary"
  elif [ $(( $(elapsed) + llimit )) -gt "$budget" ]; then
    printf '%-24s skipped: the run budget (%ss) is spent\n' "$name" "$budget" >> "$summary"
  else
    step "$name: $(basename "$whl")"
    PY="$W/py"
    # No network there: the wheel alone (torch is the machine's). A platform tag pip will not take
    # is no reason to fail: a wheel is a zip.
    if ! python3 -m pip install --no-deps --no-index --target "$PY" "$whl" > "$R/$name-pip.txt" 2>&1; then
      echo "pip refused the wheel (see $name-pip.txt): unzipping it"
      python3 -m zipfile -e "$whl" "$PY"
    fi
    layouts() {  # NAME LIMIT_S ARGS...: one driver run, its table and JSON under $R, a summary line
      local n=$1 lim=$2
      shift 2
      PYTHONPATH="$PY" KVPUSH_NIXL_LIB_DIR="$W/nixl-cu13/lib" timeout "$lim" python3 "$C/connector_layouts.py" \
        --device cuda:0 --budget-s $(( lim * 3 / 4 )) --json "$R/$n.json" "$@" > "$R/$n.txt" 2>&1
      local code=$?
      tail -30 "$R/$n.txt"
      local line
      line="$(grep -E '^connector_layouts: [0-9]' "$R/$n.txt" | tail -1)"
      printf '%-24s exit %3d  %s\n' "$n" "$code" "${line:-no summary line (see $n.txt)}" >> "$summary"
    }
    # shellcheck disable=SC2086 # the extra arguments are meant to split
    layouts "$name" "$llimit" ${KVPUSH_CHECK_LAYOUTS_ARGS:-}
    # Layer-wise on CUDA (issue #21): save_kv_layer records an event behind each layer's write (which
    # waits behind a GPU sleep) and the feeder thread hands the layer over once it completed; every
    # byte checked, and the hooks' host time must stay under a quarter of the GPU's. Its control, a
    # feeder that does not wait, must fail (exit 1).
    lw="--modes layerwise --buffers cuda --layouts flash_attn_nhd,flashinfer_hnd,mla_latent,kernel_blocks"
    # shellcheck disable=SC2086
    layouts connector-layerwise 120 $lw
    # shellcheck disable=SC2086
    layouts connector-lw-control 60 $lw --control-no-wait --layouts flash_attn_nhd
  fi
fi

step "summary"
cat "$summary"
cp "$summary" "$OUT/machine.txt" "$R/"
tar -C "$R" -czf "$OUT/results.tar.gz" .
echo "done in $(elapsed) s"
