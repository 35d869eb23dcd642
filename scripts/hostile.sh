#!/usr/bin/env bash
# The hostile probe (issue #19): builds kvpush (release), starts a P/D pair as two processes over real
# NIXL with a secret set, serves verified traffic, attacks it from separate processes on loopback, and
# prints one line per attack and the table. `--json PATH` writes the report; other arguments go to
# `kvpush hostile` (see --help; e.g. `--connections 2000` for CI). Exits non-zero if a target is
# missed: an attack accepted, a real request failed, RSS growth over 64 MiB, more than 64 threads.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/nixl.sh
. scripts/nixl.sh
cargo build --release --quiet -p kvpush-cli
exec ./target/release/kvpush hostile "$@"
