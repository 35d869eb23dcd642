#!/usr/bin/env bash
# One setup's P, D and router, kept up until Ctrl-C (for trying requests by hand).
set -euo pipefail
# shellcheck source=lib.sh source-path=SCRIPTDIR
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
  cat <<'EOF'
Usage: benches/hardware/up.sh --platform trn|p5en --p-host SSH_DEST --d-host SSH_DEST --setup NAME [options]

Starts one setup exactly as sweep.sh does (P on the P host, D on the D host, `kvpush router` here in
the setup's mode), prints the router's URL and a request to try, and keeps everything up until Ctrl-C
(or SIGTERM), which stops P, D and the router. Nothing is measured.

  --setup NAME            kvpush-push, kvpush-pull, vllm-push or vllm-pull (default kvpush-push)

EOF
  common_usage
}

parse_common "$@"
SETUPS=kvpush-push
i=0
while [ "$i" -lt "${#EXTRA_ARGS[@]}" ]; do
  case ${EXTRA_ARGS[$i]} in
    -h | --help) usage; exit 0 ;;
    --setup)
      SETUPS=${EXTRA_ARGS[$((i + 1))]:-}
      [ -n "$SETUPS" ] || die "--setup needs a value"
      i=$((i + 2))
      ;;
    *) die "unknown argument '${EXTRA_ARGS[$i]}' (up.sh --help lists the options)" ;;
  esac
done
[[ $SETUPS != *,* ]] || die "up.sh runs one setup (--setup NAME); sweep.sh runs several"
validate_common
SETUP=${SETUP_LIST[0]}

explain_dry_run
[ "$SKIP_CHECKS" = 1 ] || run_checks
install_trap

say "== $SETUP: $(setup_description "$SETUP") (router --mode $(setup_mode "$SETUP"))"
start_servers "$SETUP" || die "$SETUP: the servers did not start (their logs: $REMOTE_DIR/logs/ on the hosts)"
start_router "$SETUP" || die "$SETUP: the router did not start (its log: $LOCAL_DIR/logs/$SETUP-router.log)"
say "up: $ROUTER_URL (P $P_ADDR:$P_PORT, D $D_ADDR:$D_PORT; logs in $REMOTE_DIR/logs/ on the hosts)"
say "try: curl -s $ROUTER_URL/v1/completions -H 'content-type: application/json' -d '{\"model\": \"$MODEL\", \"prompt\": \"Hello\", \"max_tokens\": 16}'"
if [ "$DRY_RUN" = 1 ]; then
  say "(dry run: here it would wait for Ctrl-C, then stop everything)"
  exit 0
fi
say "Ctrl-C stops P, D and the router"
while :; do
  sleep 10
  for entry in "${STARTED[@]}"; do
    IFS='|' read -r label host dir name <<<"$entry"
    if ! on_host "$label" "$host" "$(q kit_alive "$dir" "$name")" >/dev/null; then
      say "$name exited; the end of its log:"
      on_host "$label" "$host" "$(q kit_tail "$dir" "$name" 60)" || true
      exit 1
    fi
  done
done
