#!/usr/bin/env bash
# The GPU push bench (benches/gpu_push.rs) on a machine with two NVIDIA GPUs that has no Rust
# toolchain and no network (the H200 pair): everything it needs is prepared here first and carried.
#
#   scripts/gpu_bench.sh --prepare        # on a build machine (network, cargo): fills .cache/gpu/ with
#                                         #   gpu_push          release build of the bench
#                                         #   nixl-cu13.tar.xz  libnixl_capi, the UCX plugin and UCX with its
#                                         #                     cuda/cma modules, from PyPI nixl-cu13==1.5.1
#                                         #   kernels.ptx       the staging kernels as PTX (NVRTC 13.0 wheel),
#                                         #                     loaded only if the GPU machine has no libnvrtc
#   scripts/gpu_bench.sh [bench args]     # on the GPU machine: unpacks NIXL, finds the CUDA runtime and
#                                         # NVRTC, records the machine, runs a smoke pass (GPU visibility
#                                         # "split", and "all" if split has no fast path), then the full
#                                         # bench. Results and logs go to $OUT (default target/gpu-bench):
#                                         # gpu-h200x2.json, smoke-*.json, machine.txt, gpu_bench.log.
#
# Environment: KVPUSH_GPU_DIR (default .cache/gpu), OUT, KVPUSH_SMOKE=0 (skip the smoke pass),
# KVPUSH_VISIBLE=split|all (skip the choice), KVPUSH_NO_FULL=1 (smoke only), KVPUSH_BUDGET_S (seconds
# the whole run may take, default 570: the full bench gets what the smoke pass left), KVPUSH_SWEEP
# ("4x2 16x2": staged-only runs with 2 slots of 4 MiB, ...), KVPUSH_CHECK_ALL=1 (also run --visible all).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
G="${KVPUSH_GPU_DIR:-.cache/gpu}"
NIXL_VERSION=1.5.1

prepare() {
  set -e
  mkdir -p "$G" .cache/gpu-build
  local b=.cache/gpu-build
  echo "== NIXL for CUDA 13: nixl-cu13==$NIXL_VERSION"
  compgen -G "$b/nixl_cu13-$NIXL_VERSION-*.whl" >/dev/null || python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$b" "nixl-cu13==$NIXL_VERSION"
  rm -rf "$b/x" "$b/pack" && mkdir -p "$b/x" "$b/pack/nixl-cu13/lib/plugins" "$b/pack/nixl-cu13/deps/ucx"
  (cd "$b/x" && unzip -q ../nixl_cu13-$NIXL_VERSION-*.whl '.nixl_cu13.mesonpy.libs/*' 'nixl_cu13.libs/*')
  # Absolute paths: with a relative LD_LIBRARY_PATH, ldd prints what it finds there relative too.
  local x p
  x="$(cd "$b/x" && pwd)"
  p="$(cd "$b/pack/nixl-cu13" && pwd)"
  mv "$x/.nixl_cu13.mesonpy.libs" "$x/lib" && mv "$x/nixl_cu13.libs" "$x/deps"
  # The C API, the UCX plugin, UCX's CUDA (cuda_copy, cuda_ipc, gdr_copy) and CMA modules, and every
  # library of the wheel these load (by ldd: grpc, absl, etcd, UCX ...). The rest (other plugins,
  # AWS/Azure SDKs, ibverbs) is left out: ~41 MB, ~8 MB as tar.xz.
  local roots="lib/libnixl_capi.so lib/plugins/libplugin_UCX.so deps/ucx/libuct_cuda.so.0.0.0 \
    deps/ucx/libucm_cuda.so.0.0.0 deps/ucx/libuct_cma.so.0.0.0"
  for f in $roots; do
    cp "$x/$f" "$p/$f"
    LD_LIBRARY_PATH="$x/lib:$x/deps" ldd "$x/$f" | awk -v x="$x/" 'index($3, x) == 1 {print $3}'
  done | sort -u | while read -r lib; do
    rel="$(realpath --relative-to="$x" "$lib")"
    cp -n "$lib" "$p/$rel"
  done
  echo "$NIXL_VERSION (PyPI nixl-cu13: libnixl_capi, UCX plugin, UCX with cuda and cma modules)" > "$p/VERSION"
  tar -C "$b/pack" -cJf "$G/nixl-cu13.tar.xz" nixl-cu13
  echo "== staging kernels as PTX (NVRTC from the nvidia-cuda-nvrtc 13.0 wheel)"
  [ -d "$b/nvrtc/nvidia" ] || {
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$b/nvrtc" "nvidia-cuda-nvrtc>=13.0,<13.1"
    (cd "$b/nvrtc" && unzip -q -o nvidia_cuda_nvrtc-*.whl 'nvidia/*')
  }
  echo "== release build of the bench"
  # shellcheck source=scripts/nixl.sh
  . scripts/nixl.sh
  local exe
  exe="$(cargo bench --bench gpu_push --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu_push" and m.get("executable"):
        print(m["executable"])')"
  [ -x "$exe" ] || { echo "no gpu_push executable built" >&2; exit 1; }
  cp "$exe" "$G/gpu_push"
  LD_LIBRARY_PATH="$(pwd)/$b/nvrtc/nvidia/cu13/lib:$LD_LIBRARY_PATH" "$G/gpu_push" --emit-ptx "$G/kernels.ptx" --arch compute_90
  ls -la "$G"
  du -sh "$G"
}

if [ "${1:-}" = "--prepare" ]; then
  prepare
  exit
fi

OUT="${OUT:-$PWD/target/gpu-bench}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_bench.log") 2>&1
started=$(date +%s)
step() { printf '\n==> %s (%ss)\n' "$*" "$(( $(date +%s) - started ))"; }

# Keep NVLink multicast off (shared machines: see the device docs).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

for f in gpu_push nixl-cu13.tar.xz; do
  [ -e "$G/$f" ] || { echo "missing $G/$f: run scripts/gpu_bench.sh --prepare on a build machine and carry $G" >&2; exit 2; }
done

step "NIXL for CUDA 13 from $G/nixl-cu13.tar.xz"
W="$(mktemp -d /tmp/kvpush-gpu.XXXXXX)"
unpack_nixl "$G/nixl-cu13.tar.xz" "$W"

step "CUDA runtime (UCX's cuda module) and NVRTC (the staging kernels)"
add_cuda_libs "$G/kernels.ptx"

step "machine"
{
  date -u
  uname -a
  nvidia-smi -L
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm,pcie.link.gen.current --format=csv
  nvidia-smi topo -m
  nvidia-smi nvlink --status 2>/dev/null | head -40
  nproc
  ldd "$G/gpu_push" | grep -E "not found|libstdc|libc\.so" || true
} 2>&1 | tee "$OUT/machine.txt"

ceiling() { python3 -c 'import json,sys; print(int(json.load(open(sys.argv[1]))["ceiling"]["gbps_median"]))' "$1" 2>/dev/null || echo 0; }

visible="${KVPUSH_VISIBLE:-}"
if [ "${KVPUSH_SMOKE:-1}" = 1 ]; then
  modes="split all"
  [ -n "$visible" ] && modes="$visible"
  best=0
  for mode in $modes; do
    step "smoke pass: --visible $mode (1k and 16k tokens, staged + direct, UCX protocol choice logged)"
    UCX_PROTO_INFO=y timeout 120 "$G/gpu_push" --bench --ptx "$G/kernels.ptx" --visible "$mode" --tokens 1024,16384 \
      --methods direct,staged,engine --warmup 1 --reps 2 --json "$OUT/smoke-$mode.json"
    echo "smoke --visible $mode: exit $?"
    c="$(ceiling "$OUT/smoke-$mode.json")"
    echo "smoke --visible $mode: ceiling ${c} GB/s"
    if [ "$c" -gt "$best" ]; then best="$c"; visible="$mode"; fi
    # NVLink through cuda_ipc gives hundreds of GB/s; below 100 the other mode is worth a try.
    [ "$c" -ge 100 ] && break
  done
  [ "$best" -gt 0 ] || { echo "no smoke pass worked: see the log" >&2; exit 3; }
fi
[ "${KVPUSH_NO_FULL:-0}" = 1 ] && exit 0

left=$(( ${KVPUSH_BUDGET_S:-570} - ($(date +%s) - started) ))
step "full bench: --visible ${visible:-split} $* (time limit ${left}s)"
timeout "$left" "$G/gpu_push" --bench --ptx "$G/kernels.ptx" --visible "${visible:-split}" --json "$OUT/gpu-h200x2.json" "$@"
rc=$?

# Staging memory against throughput: "MIBxSLOTS" per entry, staged method only.
for s in ${KVPUSH_SWEEP:-}; do
  step "staging sweep: ${s#*x} slots of ${s%x*} MiB"
  timeout 90 "$G/gpu_push" --bench --ptx "$G/kernels.ptx" --visible "${visible:-split}" --methods staged \
    --slot-mib "${s%x*}" --slots "${s#*x}" --json "$OUT/sweep-$s.json" > /dev/null
  echo "sweep $s: exit $?"
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("\n".join("%6d %-10s %7.1f GB/s %5.1f%%" % (c["tokens"], c["pattern"], c["gbps_median"], 100*c["gbps_median"]/d["ceiling"]["gbps_median"]) for c in d["cases"] if c["method"]=="staged"))' "$OUT/sweep-$s.json" || true
done
# The other GPU-visibility mode, as a check of the NIXL device-id workaround.
if [ "${KVPUSH_CHECK_ALL:-0}" = 1 ] && [ "${visible:-split}" != all ]; then
  step "--visible all (both processes see both GPUs: P on device 0, D on device 1)"
  timeout 120 "$G/gpu_push" --bench --ptx "$G/kernels.ptx" --visible all --tokens 1024,16384 --methods direct,staged,engine \
    --json "$OUT/visible-all.json" > /dev/null
  echo "visible all: exit $?"
fi
step "done: exit $rc"
exit $rc
