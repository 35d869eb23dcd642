#!/usr/bin/env bash
# Runs every check and test of kvpush: formatting, clippy (warnings are errors), unit, property,
# corpus and integration tests, doc tests, and one pass of each benchmark in test mode.
# Idempotent; set-up steps (NIXL now; Python packages and vLLM with the connector) are cached.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }
started=$(date +%s)

step "toolchain: $(cargo --version)"

if [[ "${CI:-}" == "true" ]]; then
    # A CI runner's disk is shared and small: line tables instead of full debug info and no
    # incremental caches keep the debug target under half its size; backtraces still name lines.
    export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=line-tables-only
    echo "CI: CARGO_INCREMENTAL=0, dev profile debug=line-tables-only"
fi

step "NIXL (libclang for bindgen, the nixl-cu12 wheel's libraries; cached in .cache/)"
# shellcheck source=scripts/nixl.sh
. scripts/nixl.sh
echo "NIXL libraries: $NIXL_LIB_DIR"

step "NVRTC (the nvidia-cuda-nvrtc wheel's libraries, for compiling the CUDA kernels; cached in .cache/)"
# shellcheck source=scripts/nvrtc.sh
. scripts/nvrtc.sh
echo "NVRTC libraries: $KVPUSH_NVRTC_DIR"

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy --workspace --all-targets -- -D warnings (and the Python module, feature python)"
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy --lib --features python -- -D warnings

step "cargo test --workspace --all-targets (unit, property, corpus, integration; benches run once)"
cargo test --workspace --all-targets

step "cargo test --doc"
cargo test --doc

step "loom model of the pool's hand-off primitives (--cfg kvpush_loom, own target dir)"
RUSTFLAGS="--cfg kvpush_loom" CARGO_TARGET_DIR=target/loom cargo test --release --test loom_pool

step "kvpush demo (the main job) on a small workload"
cargo run --release --quiet -p kvpush-cli -- demo --requests 40 --quiet --json target/demo-ci.json

step "hostile probe: the P/D pair attacked from separate processes (scripts/hostile.sh; ~75 s)"
./scripts/hostile.sh --json target/hostile-ci.json

step "fault suite, CI setting: every scenario, a tenth of the requests (scripts/faults.sh --ci)"
./scripts/faults.sh --ci --json target/faults-ci.json

step "Python: vLLM (CPU build), NIXL wheels, test tools (scripts/python.sh; cached in .cache/)"
# shellcheck source=scripts/python.sh
. scripts/python.sh
step "the kvpush Python package into that venv (maturin develop --release)"
maturin develop --release --quiet
step "pytest tests/python (real vLLM servers behind kvpush router)"
python -m pytest tests/python -v -rA --durations=0

step "all checks passed in $(( $(date +%s) - started )) s"
