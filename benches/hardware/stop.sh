#!/usr/bin/env bash
# Stops whatever the kit left running on the P and D hosts and here (after a driver that died hard).
set -euo pipefail
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF'
Usage: benches/hardware/stop.sh --p-host SSH_DEST --d-host SSH_DEST [--remote-dir DIR] [--local-dir DIR] [--dry-run]

sweep.sh and up.sh stop everything they started when they end, fail or get Ctrl-C. If the driver
itself was killed (kill -9, a lost ssh session), servers stay up: this stops every process group the
kit recorded in a pid file, under --remote-dir/run on both hosts and --local-dir/run here (the
router): SIGTERM, then SIGKILL after 30 s. Processes the kit did not start are never touched.

Options: --p-host, --d-host, --remote-dir, --local-dir, --dry-run as in sweep.sh --help (and the same
environment variables: KVPUSH_HW_P_HOST, KVPUSH_HW_D_HOST, KVPUSH_HW_REMOTE_DIR, KVPUSH_HW_LOCAL_DIR,
KVPUSH_HW_SSH_OPTS).
EOF
}

parse_common "$@"
reject_extra_args
[ -n "$P_HOST" ] || die "--p-host is required (or KVPUSH_HW_P_HOST)"
[ -n "$D_HOST" ] || die "--d-host is required (or KVPUSH_HW_D_HOST)"

explain_dry_run
rc=0
on_host P "$P_HOST" "$(q kit_stop_all "$REMOTE_DIR")" || rc=1
if [ "$D_HOST" != "$P_HOST" ]; then
  on_host D "$D_HOST" "$(q kit_stop_all "$REMOTE_DIR")" || rc=1
fi
on_host router local "$(q kit_stop_all "$LOCAL_DIR")" || rc=1
exit "$rc"
