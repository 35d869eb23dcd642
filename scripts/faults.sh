#!/usr/bin/env bash
# The fault suite (issue 16): builds kvpush (release) and plays every scenario (each window of the
# issue, side-channel cuts, aborts at every stage, vLLM's push reliability list; in this process over
# real threads, the loopback data path and real TCP side channels, and P and D as two processes over
# real NIXL for kill -9 and SIGSTOP). One progress line per scenario on stderr, then the table.
# `--ci` is the short setting (a tenth of the requests), `--json PATH` writes the report, `--only NAME`
# runs the scenarios whose name contains NAME. Exits non-zero if a target is missed: any corrupt or
# leaked block, hung request or protocol violation, fewer than 20 scenarios, or (full setting)
# fewer than 10,000 requests.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/nixl.sh
. scripts/nixl.sh
cargo build --release --quiet -p kvpush-cli
echo "kvpush faults: $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) cores, started $(date -u +%H:%M:%S)" >&2
exec ./target/release/kvpush faults "$@"
