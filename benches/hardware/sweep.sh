#!/usr/bin/env bash
# The push-vs-pull sweep on two hosts: for each setup, P and D (vLLM, TP 8) on their hosts, kvpush
# router here, the client through it, one JSON for the run and its plot. `sweep.sh --help` explains.
set -euo pipefail
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF'
Usage: benches/hardware/sweep.sh --platform trn|p5en --p-host SSH_DEST --d-host SSH_DEST [options]

The seed experiment's push-vs-pull sweep on two hosts (docs/deployment.md walks through it). For each
setup in turn:

  1. starts vLLM's OpenAI server for P on the P host and for D on the D host (over ssh; Qwen3-32B,
     TP 8, the setup's --kv-transfer-config) and waits until both answer /health;
  2. starts `kvpush router --mode push|pull` on this machine, in front of them;
  3. runs the client (benches/hardware/client.py: warm-up, then for every request rate and input
     length --requests streaming greedy completions of --max-tokens tokens at Poisson arrivals);
  4. copies the servers' and the router's logs next to the results, and stops all three.

Setups (--setups, default all four):
  kvpush-push   kvpush.vllm.KVPushConnector, mode push   (router --mode push)
  kvpush-pull   kvpush.vllm.KVPushConnector, mode pull   (router --mode pull)
  vllm-push     vLLM's NixlPushConnector, as shipped     (router --mode push)
  vllm-pull     vLLM's NixlConnector, as shipped         (router --mode pull)

Results: one JSON per run, --out (default benches/results/hw-PLATFORM-UTCTIME.json; the schema of
benches/vllm_pd.py), its plot next to it (.png: TTFT and TPOT p50/p99 against input length, one column
per request rate), and the logs in the directory of the same name. Prerequisites are checked first
on this machine and both hosts (check.sh does only that). Ctrl-C, an error or the end stop every
server this run started, on both hosts and here.

Sweep:
  --setups LIST           comma-separated (default kvpush-push,kvpush-pull,vllm-push,vllm-pull)
  --lengths LIST          input lengths in tokens (default 1024,2048,4096,8192,16384)
  --rates LIST            request rates, requests per second (default 1,2,4,8)
  --requests N            requests per (rate, length) cell (default 64)
  --max-tokens N          output tokens per request (default 128)
  --no-logprobs           do not ask for logprobs (tokens timed by text chunks instead)
  --out FILE              the run's JSON

EOF
  common_usage
  cat <<'EOF'

Examples:
  benches/hardware/sweep.sh --platform p5en --p-host ubuntu@10.0.0.5 --d-host ubuntu@10.0.0.6 \
      --python /opt/vllm/bin/python --dry-run
  KVPUSH_HW_P_HOST=ubuntu@10.0.1.5 KVPUSH_HW_D_HOST=ubuntu@10.0.1.6 \
      benches/hardware/sweep.sh --platform trn --python /opt/aws_neuronx_venv/bin/python
EOF
}

parse_common "$@"
reject_extra_args
validate_common
[[ $LENGTHS =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--lengths must be comma-separated whole numbers, not '$LENGTHS'"
[[ $RATES =~ ^[0-9.]+(,[0-9.]+)*$ ]] || die "--rates must be comma-separated numbers, not '$RATES'"

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-$REPO/benches/results/hw-$PLATFORM-$STAMP.json}
case $OUT in /*) ;; *) OUT="$PWD/$OUT" ;; esac
[[ $OUT == *.json ]] || die "--out must name a .json file (the plot and the logs go next to it), not '$OUT'"
LOG_DIR=${OUT%.json}

explain_dry_run
[ "$SKIP_CHECKS" = 1 ] || run_checks
install_trap

META=$(printf '{"kit": "benches/hardware/sweep.sh", "platform": %s, "p_host": %s, "d_host": %s, "p_addr": %s, "d_addr": %s, "tp": %s, "nixl_backend": %s, "model": %s, "max_model_len": %s, "vllm_args": %s, "vllm_kv_buffer_device": %s, "server_env": %s, "remote_python": %s, "logs": %s, "command": %s}' \
  "$(json_str "$PLATFORM")" "$(json_str "$P_HOST")" "$(json_str "$D_HOST")" "$(json_str "$P_ADDR")" \
  "$(json_str "$D_ADDR")" "$TP" "$(json_str "$NIXL_BACKEND")" "$(json_str "$MODEL")" "$MAX_MODEL_LEN" \
  "$(json_str "$VLLM_ARGS_STR")" "$(json_str "$VLLM_KV_BUFFER_DEVICE")" \
  "$(json_str "${SERVER_ENVS[*]+"${SERVER_ENVS[*]}"}")" "$(json_str "$REMOTE_PY")" "$(json_str "$LOG_DIR")" \
  "$(json_str "benches/hardware/sweep.sh $(q "$@")")")

# run_client ARGS...: the client in the background, so the trap can stop it at once on Ctrl-C.
run_client() {
  printf '+ %s\n' "$(q "$LOCAL_PY" "$CLIENT_PY" run "$@")"
  [ "$DRY_RUN" = 1 ] && return 0
  "$LOCAL_PY" "$CLIENT_PY" run "$@" &
  CLIENT_PID=$!
  local rc=0
  wait "$CLIENT_PID" || rc=$?
  CLIENT_PID=""
  return "$rc"
}

failed=()
for setup in "${SETUP_LIST[@]}"; do
  say "== $setup: $(setup_description "$setup") (router --mode $(setup_mode "$setup"))"
  record=(--out "$OUT" --setup "$setup" --mode "$(setup_mode "$setup")" --description "$(setup_description "$setup")"
    --p-config "$(kv_config P "$setup")" --d-config "$(kv_config D "$setup")" --meta "$META" --model "$MODEL"
    --lengths "$LENGTHS" --rates "$RATES" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS")
  while IFS= read -r e; do record+=(--p-env "$e"); done < <(server_env P "$setup")
  while IFS= read -r e; do record+=(--d-env "$e"); done < <(server_env D "$setup")
  [ "$NO_LOGPROBS" = 0 ] || record+=(--no-logprobs)
  if start_servers "$setup" && start_router "$setup"; then
    run_client "${record[@]}" --router-url "$ROUTER_URL" || failed+=("$setup")
  else
    failed+=("$setup")
    run "$LOCAL_PY" "$CLIENT_PY" run "${record[@]}" \
      --error "the servers or the router did not start; logs in $LOG_DIR/$setup" || true
  fi
  fetch_logs "$setup" "$LOG_DIR/$setup"
  stop_started
done

run "$LOCAL_PY" "$CLIENT_PY" plot "$OUT"
say "results: $OUT, plot ${OUT%.json}.png, logs $LOG_DIR/"
if [ "${#failed[@]}" -gt 0 ]; then
  say "setups with failures: ${failed[*]} (their error is in the JSON, their logs under $LOG_DIR/)"
  exit 1
fi
