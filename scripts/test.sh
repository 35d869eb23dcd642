#!/usr/bin/env bash
# Runs every check and test of kvpush: formatting, clippy (warnings are errors), unit, property,
# corpus and integration tests, doc tests, and one pass of each benchmark in test mode.
# Idempotent; set-up steps (added by later parts: NIXL, Python packages, vLLM) are cached.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }
started=$(date +%s)

step "toolchain: $(cargo --version)"
rustup component list --installed 2>/dev/null | grep -qE '^(rustfmt|clippy)' || true

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets -- -D warnings

step "cargo test --all-targets (unit, property, corpus, integration; benches run once)"
cargo test --all-targets

step "cargo test --doc"
cargo test --doc

step "all checks passed in $(( $(date +%s) - started )) s"
