#!/usr/bin/env bash
# The hardware bench kit's prerequisite checks, on this machine and on the P and D hosts.
set -euo pipefail
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF'
Usage: benches/hardware/check.sh --platform trn|p5en --p-host SSH_DEST --d-host SSH_DEST [options]

Checks, without starting anything, what sweep.sh and up.sh need (they run the same checks first):

  this machine (the driver): `kvpush router --help` runs; the client's Python has requests and
      matplotlib and imports benches/vllm_pd.py; the router's port is free;
  each host (over ssh): EFA (`fi_info -p efa`, with the LIBFABRIC backend); trn: `neuron-ls` and
      libnrt.so.1; p5en: `nvidia-smi -L` lists at least --tp GPUs; setsid; vLLM importable by --python;
      the kvpush wheel (`import kvpush.vllm`, when a kvpush setup is selected); vLLM's NixlConnector
      and NixlPushConnector (when a vllm setup is selected); the NIXL backend plugin
      (libplugin_LIBFABRIC.so or libplugin_UCX.so) and every library it links (ldd); the HTTP and
      side-channel ports free.

Each check prints one ok or FAIL line saying what to fix; the exit status is 0 only when all pass.

EOF
  common_usage
  cat <<'EOF'
  --setups LIST           which setups' software to check (default all four)
EOF
}

parse_common "$@"
reject_extra_args
validate_common
explain_dry_run
run_checks
