#!/usr/bin/env bash
# The main job: builds kvpush (release) and runs `kvpush demo` on its embedded default workload — a
# P engine and a D engine pushing (then pulling) 200 requests of a scaled-down Qwen3-32B layout,
# every byte verified — then prints the table. Extra arguments go to `kvpush demo` (see --help),
# e.g. `./scripts/demo.sh --transport nixl --processes 2`. Set-up (libclang for the build, NIXL's
# libraries) is idempotent and cached by scripts/nixl.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/nixl.sh
. scripts/nixl.sh
cargo build --release --quiet -p kvpush-cli
exec ./target/release/kvpush demo "$@"
