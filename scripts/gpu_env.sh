# Sourced by scripts/gpu_bench.sh and scripts/gpu_check.sh on the GPU machine (no Rust toolchain, no
# network): unpacks the carried NIXL for CUDA 13 and finds the CUDA runtime and NVRTC there.
# Defines functions only; the caller's `step` prints the headings.

# unpack_nixl ARCHIVE DIR: unpacks nixl-cu13.tar.xz (made by scripts/gpu_bench.sh --prepare) into DIR,
# prints its version and points NIXL_PLUGIN_DIR and LD_LIBRARY_PATH at it.
unpack_nixl() {
  tar -C "$2" -xJf "$1"
  cat "$2/nixl-cu13/VERSION"
  export NIXL_PLUGIN_DIR="$2/nixl-cu13/lib/plugins"
  export LD_LIBRARY_PATH="$2/nixl-cu13/lib:$2/nixl-cu13/deps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

site_dirs() { python3 -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null; }

# find_lib NAME: the folder holding library NAME (the CUDA toolkit's, the system's, or a pip wheel's
# under nvidia/), or nothing.
find_lib() {
  local name="$1" d s
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/$name" ] && { echo "$d"; return; }
  done
  for s in $(site_dirs); do
    d="$(find "$s/nvidia" -maxdepth 3 -name "$name" 2>/dev/null | head -1)"
    [ -n "$d" ] && { dirname "$d"; return; }
  done
}

# add_cuda_libs PTX: appends the folders of the CUDA 13 runtime (UCX's cuda module) and NVRTC (the
# staging kernels) to LD_LIBRARY_PATH; a missing NVRTC means the kernels come from PTX.
add_cuda_libs() {
  local lib d
  for lib in libcudart.so.13 libnvrtc.so.13; do
    d="$(find_lib "$lib")"
    if [ -n "$d" ]; then
      echo "$lib: $d"
      export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$d"
    else
      echo "$lib: not found (kernels then come from $1)"
    fi
  done
}
