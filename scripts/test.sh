#!/usr/bin/env bash
# Runs every check and test of kvpush: formatting, clippy (warnings are errors), unit, property,
# corpus and integration tests, doc tests, and one pass of each benchmark in test mode.
# Idempotent; set-up steps (NIXL now; Python packages and vLLM with the connector) are cached.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }
started=$(date +%s)

step "toolchain: $(cargo --version)"

step "NIXL (libclang for bindgen, the nixl-cu12 wheel's libraries; cached in .cache/)"
# shellcheck source=scripts/nixl.sh
. scripts/nixl.sh
echo "NIXL libraries: $NIXL_LIB_DIR"

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets -- -D warnings

step "cargo test --all-targets (unit, property, corpus, integration; benches run once)"
cargo test --all-targets

step "cargo test --doc"
cargo test --doc

step "loom model of the pool's hand-off primitives (--cfg kvpush_loom, own target dir)"
RUSTFLAGS="--cfg kvpush_loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_pool

step "kvpush demo (the main job) on a small workload"
cargo run --release --quiet -- demo --requests 40 --quiet --json target/demo-ci.json

step "all checks passed in $(( $(date +%s) - started )) s"
