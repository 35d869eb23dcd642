#!/usr/bin/env bash
# Provides NIXL for development and tests on a fresh machine, idempotently and cached:
#   - Debian's libclang1-14 and libclang-common-14-dev (bindgen, used by nixl-sys's build script);
#   - the shared libraries of the PyPI wheel nixl-cu12==1.5.1 (libnixl_capi.so, libnixl.so, the UCX
#     plugin and UCX itself; no CUDA is loaded) unpacked into $KVPUSH_CACHE/nixl-cu12-1.5.1.
# Source it (". scripts/nixl.sh") to get NIXL_LIB_DIR, NIXL_PLUGIN_DIR and LD_LIBRARY_PATH set, or run
# it to print them. Set KVPUSH_NO_APT=1 to skip the apt step (then libclang must already be present).
set -euo pipefail

_kvp_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVPUSH_CACHE="${KVPUSH_CACHE:-$_kvp_root/.cache}"
_nixl_version=1.5.1
_nixl_dir="$KVPUSH_CACHE/nixl-cu12-$_nixl_version"

_kvp_have_libclang() {
  ls /usr/lib/llvm-14/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang-14.so* >/dev/null 2>&1 \
    && [ -d /usr/lib/llvm-14/lib/clang ]
}

if ! _kvp_have_libclang; then
  if [ "${KVPUSH_NO_APT:-0}" = 1 ]; then
    echo "scripts/nixl.sh: libclang 14 is missing and KVPUSH_NO_APT=1" >&2
    exit 1
  fi
  echo "scripts/nixl.sh: installing libclang1-14 libclang-common-14-dev (bindgen)" >&2
  _sudo=""; [ "$(id -u)" = 0 ] || _sudo="sudo"
  $_sudo apt-get update -qq >/dev/null || true
  DEBIAN_FRONTEND=noninteractive $_sudo apt-get install -y -qq libclang1-14 libclang-common-14-dev >/dev/null
fi

if [ ! -f "$_nixl_dir/.complete" ]; then
  echo "scripts/nixl.sh: fetching nixl-cu12==$_nixl_version into $_nixl_dir" >&2
  mkdir -p "$KVPUSH_CACHE/wheels" "$_nixl_dir"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    -d "$KVPUSH_CACHE/wheels" "nixl-cu12==$_nixl_version"
  _whl="$(ls "$KVPUSH_CACHE"/wheels/nixl_cu12-"$_nixl_version"-*.whl | head -1)"
  python3 - "$_whl" "$_nixl_dir" <<'PY'
import sys, zipfile, os
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        name = info.filename
        if not (name.startswith(".nixl_cu12.mesonpy.libs/") or name.startswith("nixl_cu12.libs/")):
            continue
        if name.endswith("/"):
            continue
        dest = os.path.join(out, "lib" if name.startswith(".nixl_cu12.mesonpy.libs/") else "deps",
                            name.split("/", 1)[1])
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with z.open(info) as src, open(dest, "wb") as dst:
            dst.write(src.read())
        os.chmod(dest, 0o755)
PY
  touch "$_nixl_dir/.complete"
fi

[ -f "$_nixl_dir/VERSION" ] || echo "$_nixl_version (PyPI nixl-cu12)" > "$_nixl_dir/VERSION"

export NIXL_LIB_DIR="$_nixl_dir/lib"
export NIXL_PLUGIN_DIR="$_nixl_dir/lib/plugins"
case ":${LD_LIBRARY_PATH:-}:" in
  *":$NIXL_LIB_DIR:"*) ;;
  *) export LD_LIBRARY_PATH="$NIXL_LIB_DIR:$_nixl_dir/deps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
esac

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "NIXL_LIB_DIR=$NIXL_LIB_DIR"
  echo "NIXL_PLUGIN_DIR=$NIXL_PLUGIN_DIR"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
fi
