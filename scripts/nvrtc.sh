#!/usr/bin/env bash
# Provides NVRTC (CUDA's run-time compiler) for the tests that compile the staging kernels to PTX,
# idempotently and cached: the shared libraries of the PyPI wheel nvidia-cuda-nvrtc==13.0.88
# (libnvrtc.so.13 and libnvrtc-builtins.so.13.0; CUDA 13.0, as cudarc's cuda-13000 feature and the GPU
# machines) unpacked into $KVPUSH_CACHE/nvrtc-13.0.88/lib. NVRTC needs no GPU and no driver
# (libcuda): kvpush-cuda opens it at run time by name (cudarc's dynamic loading), so putting that
# directory on LD_LIBRARY_PATH is all it takes.
# Source it (". scripts/nvrtc.sh") to get KVPUSH_NVRTC_DIR and LD_LIBRARY_PATH set, or run it to print
# them. scripts/test.sh sources it; under CI=true the kernel-compilation test fails without NVRTC.
set -euo pipefail

_kvp_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVPUSH_CACHE="${KVPUSH_CACHE:-$_kvp_root/.cache}"
_nvrtc_version=13.0.88
_nvrtc_dir="$KVPUSH_CACHE/nvrtc-$_nvrtc_version"

if [ ! -f "$_nvrtc_dir/.complete" ]; then
  echo "scripts/nvrtc.sh: fetching nvidia-cuda-nvrtc==$_nvrtc_version into $_nvrtc_dir" >&2
  mkdir -p "$KVPUSH_CACHE/wheels" "$_nvrtc_dir/lib"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$KVPUSH_CACHE/wheels" "nvidia-cuda-nvrtc==$_nvrtc_version"
  _whl="$(ls "$KVPUSH_CACHE"/wheels/nvidia_cuda_nvrtc-"$_nvrtc_version"-*.whl | head -1)"
  python3 - "$_whl" "$_nvrtc_dir/lib" <<'PY'
import os, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
wanted = ("libnvrtc.so.13", "libnvrtc-builtins.so.13.0")
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        name = os.path.basename(info.filename)
        if info.filename.startswith("nvidia/cu13/lib/") and name in wanted:
            with z.open(info) as src, open(os.path.join(out, name), "wb") as dst:
                dst.write(src.read())
            os.chmod(os.path.join(out, name), 0o755)
missing = [n for n in wanted if not os.path.exists(os.path.join(out, n))]
if missing:
    sys.exit(f"{whl} lacks {missing}")
PY
  touch "$_nvrtc_dir/.complete"
fi

export KVPUSH_NVRTC_DIR="$_nvrtc_dir/lib"
case ":${LD_LIBRARY_PATH:-}:" in
  *":$KVPUSH_NVRTC_DIR:"*) ;;
  *) export LD_LIBRARY_PATH="$KVPUSH_NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
esac

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "KVPUSH_NVRTC_DIR=$KVPUSH_NVRTC_DIR"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
fi
