# shellcheck shell=bash
# shellcheck disable=SC2034 # the options are read by the scripts that source this file
# The driver side of the hardware bench kit, sourced by check.sh, up.sh, sweep.sh and stop.sh.
#
# The driver is the machine the scripts run on (a third instance in the same VPC, or the P host
# itself). It reaches the P and D hosts with ssh, runs `kvpush router` and the benchmark client
# itself, and sends benches/hardware/remote.sh plus one function call to each host for every remote
# step (remote.sh lists the functions). With --dry-run every command is printed instead of run.

KIT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$KIT_DIR/../.." && pwd)"
REMOTE_SH="$KIT_DIR/remote.sh"
CLIENT_PY="$KIT_DIR/client.py"

# ---------------------------------------------------------------------------------------------------
# Options (flags win over the environment, the environment over the defaults).

PLATFORM=${KVPUSH_HW_PLATFORM:-}
P_HOST=${KVPUSH_HW_P_HOST:-}
D_HOST=${KVPUSH_HW_D_HOST:-}
P_ADDR=${KVPUSH_HW_P_ADDR:-}
D_ADDR=${KVPUSH_HW_D_ADDR:-}
REMOTE_PY=${KVPUSH_HW_PYTHON:-python3}
LOCAL_PY=${KVPUSH_HW_LOCAL_PYTHON:-python3}
REMOTE_DIR=${KVPUSH_HW_REMOTE_DIR:-/tmp/kvpush-hw}
LOCAL_DIR=${KVPUSH_HW_LOCAL_DIR:-${TMPDIR:-/tmp}/kvpush-hw-driver}
MODEL=Qwen/Qwen3-32B
TP=8
MAX_MODEL_LEN=17408
NIXL_BACKEND=LIBFABRIC
P_PORT=8100
D_PORT=8200
P_SIDE_PORT=5600
D_SIDE_PORT=5600
ROUTER_LISTEN=127.0.0.1:8000
KVPUSH_BIN_OPT=${KVPUSH_BIN:-}
SETUPS=kvpush-push,kvpush-pull,vllm-push,vllm-pull
VLLM_ARGS_STR=""
KVPUSH_EXTRA=""
PEER_TIMEOUT_MS=15000
VLLM_KV_BUFFER_DEVICE=""
SERVER_TIMEOUT_S=2400
LENGTHS=1024,2048,4096,8192,16384
RATES=1,2,4,8
REQUESTS=64
MAX_TOKENS=128
OUT=""
SKIP_CHECKS=0
DRY_RUN=0
NO_LOGPROBS=0
SERVER_ENVS=()
POLL_S=${KVPUSH_HW_POLL_S:-10}   # seconds between readiness polls
read -r -a SSH_OPTS <<<"${KVPUSH_HW_SSH_OPTS:--o BatchMode=yes -o ConnectTimeout=10}"

KNOWN_SETUPS="kvpush-push kvpush-pull vllm-push vllm-pull"

common_usage() {
  cat <<'EOF'
Hosts (flags, or the environment variables in brackets):
  --platform trn|p5en     trn: trn1/trn2 (Neuron device memory, vLLM's Neuron build); p5en: H200 CUDA
                          [KVPUSH_HW_PLATFORM]
  --p-host SSH_DEST       the prefill (P) host, as ssh reaches it, e.g. ubuntu@10.0.0.5 [KVPUSH_HW_P_HOST]
  --d-host SSH_DEST       the decode (D) host [KVPUSH_HW_D_HOST]
  --p-addr ADDR           P's address as D and the router reach it (default: --p-host without user@)
                          [KVPUSH_HW_P_ADDR]; it is also P's advertised side-channel host
  --d-addr ADDR           D's address (default: --d-host without user@) [KVPUSH_HW_D_ADDR]
  --python PY             the interpreter on the hosts that has vLLM and kvpush (default python3)
                          [KVPUSH_HW_PYTHON]
  --local-python PY       the driver's interpreter for the client and the plot, with requests and
                          matplotlib (default python3) [KVPUSH_HW_LOCAL_PYTHON]
  --remote-dir DIR        the kit's directory on the hosts: server logs and pid files
                          (default /tmp/kvpush-hw) [KVPUSH_HW_REMOTE_DIR]
  --local-dir DIR         the driver's: the router's log and pid file (default $TMPDIR/kvpush-hw-driver)
                          [KVPUSH_HW_LOCAL_DIR]
  ssh options: [KVPUSH_HW_SSH_OPTS] (default "-o BatchMode=yes -o ConnectTimeout=10"), also used by scp
  seconds between readiness polls of a starting server: [KVPUSH_HW_POLL_S] (default 10)

Servers:
  --model NAME            (default Qwen/Qwen3-32B)
  --tp N                  tensor-parallel size of P and of D (default 8)
  --max-model-len N       (default 17408: 16k input, 128 output, headroom)
  --nixl-backend B        LIBFABRIC (EFA; default) or UCX (InfiniBand, RoCE, one host)
  --p-port N, --d-port N  vLLM HTTP ports (default 8100, 8200)
  --p-side-port N, --d-side-port N
                          first side-channel port of P and of D (default 5600 each); TP rank r of
                          kvpush listens on PORT + r, vLLM's NIXL connectors on PORT
  --router-listen ADDR    where `kvpush router` listens on the driver (default 127.0.0.1:8000)
  --kvpush-bin PATH       the kvpush binary on the driver (default $KVPUSH_BIN, else
                          target/release/kvpush, else kvpush on PATH)
  --vllm-args "ARGS"      more vLLM server arguments for P and D (split on spaces)
  --env K=V               one more environment variable for both servers and the host checks (repeat)
  --kvpush-extra 'MEMBERS'
                          JSON members appended to kvpush's kv_connector_extra_config,
                          e.g. '"lease_ms": 30000, "writers": 2' (keys: docs/vllm.md)
  --peer-timeout-ms N     kvpush's peer_timeout_ms (default 15000)
  --vllm-kv-buffer-device cuda|cpu
                          kv_buffer_device of vLLM's own connectors (default cuda: device memory,
                          which on trn is Neuron HBM; vllm-neuron 0.24 refuses cpu)
  --server-timeout-s N    how long a server may take to answer /health (default 2400)
  --skip-checks           do not run the prerequisite checks first
  --dry-run               print every command instead of running it
  -h, --help              this text
EOF
}

die() {
  printf 'error: %s\n' "$*" >&2
  exit 2
}

# The part of an ssh destination after user@ (and without a :port).
addr_of() {
  local h=${1#*@}
  printf '%s' "${h%%:*}"
}

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

# Parses the options shared by the scripts; the rest of argv goes to EXTRA_ARGS for the script.
parse_common() {
  EXTRA_ARGS=()
  while [ "$#" -gt 0 ]; do
    case $1 in
      --platform) PLATFORM=${2:?--platform needs a value}; shift 2 ;;
      --p-host) P_HOST=${2:?--p-host needs a value}; shift 2 ;;
      --d-host) D_HOST=${2:?--d-host needs a value}; shift 2 ;;
      --p-addr) P_ADDR=${2:?--p-addr needs a value}; shift 2 ;;
      --d-addr) D_ADDR=${2:?--d-addr needs a value}; shift 2 ;;
      --python) REMOTE_PY=${2:?--python needs a value}; shift 2 ;;
      --local-python) LOCAL_PY=${2:?--local-python needs a value}; shift 2 ;;
      --remote-dir) REMOTE_DIR=${2:?--remote-dir needs a value}; shift 2 ;;
      --local-dir) LOCAL_DIR=${2:?--local-dir needs a value}; shift 2 ;;
      --model) MODEL=${2:?--model needs a value}; shift 2 ;;
      --tp) TP=${2:?--tp needs a value}; shift 2 ;;
      --max-model-len) MAX_MODEL_LEN=${2:?--max-model-len needs a value}; shift 2 ;;
      --nixl-backend) NIXL_BACKEND=${2:?--nixl-backend needs a value}; shift 2 ;;
      --p-port) P_PORT=${2:?--p-port needs a value}; shift 2 ;;
      --d-port) D_PORT=${2:?--d-port needs a value}; shift 2 ;;
      --p-side-port) P_SIDE_PORT=${2:?--p-side-port needs a value}; shift 2 ;;
      --d-side-port) D_SIDE_PORT=${2:?--d-side-port needs a value}; shift 2 ;;
      --router-listen) ROUTER_LISTEN=${2:?--router-listen needs a value}; shift 2 ;;
      --kvpush-bin) KVPUSH_BIN_OPT=${2:?--kvpush-bin needs a value}; shift 2 ;;
      --setups) SETUPS=${2:?--setups needs a value}; shift 2 ;;
      --vllm-args) VLLM_ARGS_STR=$2; shift 2 ;;
      --env) SERVER_ENVS+=("${2:?--env needs K=V}"); shift 2 ;;
      --kvpush-extra) KVPUSH_EXTRA=$2; shift 2 ;;
      --peer-timeout-ms) PEER_TIMEOUT_MS=${2:?--peer-timeout-ms needs a value}; shift 2 ;;
      --vllm-kv-buffer-device) VLLM_KV_BUFFER_DEVICE=${2:?--vllm-kv-buffer-device needs a value}; shift 2 ;;
      --server-timeout-s) SERVER_TIMEOUT_S=${2:?--server-timeout-s needs a value}; shift 2 ;;
      --lengths) LENGTHS=${2:?--lengths needs a value}; shift 2 ;;
      --rates) RATES=${2:?--rates needs a value}; shift 2 ;;
      --requests) REQUESTS=${2:?--requests needs a value}; shift 2 ;;
      --max-tokens) MAX_TOKENS=${2:?--max-tokens needs a value}; shift 2 ;;
      --no-logprobs) NO_LOGPROBS=1; shift ;;
      --out) OUT=${2:?--out needs a value}; shift 2 ;;
      --skip-checks) SKIP_CHECKS=1; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      *) EXTRA_ARGS+=("$1"); shift ;;
    esac
  done
}

# Checks the options; fills in the derived values.
# The arguments parse_common left to the script, for scripts that take no others: --help prints the
# script's `usage`, anything else is an error naming the script.
reject_extra_args() {
  local a
  for a in "${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}"; do
    case $a in
      -h | --help) usage; exit 0 ;;
      *) die "unknown argument '$a' ($(basename "$0") --help lists the options)" ;;
    esac
  done
}

validate_common() {
  case $PLATFORM in
    trn | p5en) ;;
    "") die "--platform is required (trn or p5en; or KVPUSH_HW_PLATFORM)" ;;
    *) die "--platform must be trn or p5en, not '$PLATFORM'" ;;
  esac
  [ -n "$P_HOST" ] || die "--p-host is required (the prefill host as ssh reaches it; or KVPUSH_HW_P_HOST)"
  [ -n "$D_HOST" ] || die "--d-host is required (the decode host as ssh reaches it; or KVPUSH_HW_D_HOST)"
  [ -n "$P_ADDR" ] || P_ADDR=$(addr_of "$P_HOST")
  [ -n "$D_ADDR" ] || D_ADDR=$(addr_of "$D_HOST")
  case $NIXL_BACKEND in
    LIBFABRIC | UCX) ;;
    *) die "--nixl-backend must be LIBFABRIC or UCX, not '$NIXL_BACKEND'" ;;
  esac
  if [ "$PLATFORM" = trn ] && [ "$NIXL_BACKEND" = UCX ]; then
    die "--nixl-backend UCX on trn: UCX has no Neuron memory type; use LIBFABRIC (docs/deployment.md)"
  fi
  local v
  for v in TP MAX_MODEL_LEN P_PORT D_PORT P_SIDE_PORT D_SIDE_PORT PEER_TIMEOUT_MS SERVER_TIMEOUT_S REQUESTS MAX_TOKENS; do
    is_uint "${!v}" || die "$(tr '[:upper:]_' '[:lower:]-' <<<"--$v") must be a whole number, not '${!v}'"
  done
  [ "$TP" -ge 1 ] || die "--tp must be at least 1"
  [ -n "$VLLM_KV_BUFFER_DEVICE" ] || VLLM_KV_BUFFER_DEVICE=cuda
  case $VLLM_KV_BUFFER_DEVICE in
    cuda | cpu) ;;
    *) die "--vllm-kv-buffer-device must be cuda or cpu, not '$VLLM_KV_BUFFER_DEVICE'" ;;
  esac
  [ "$REQUESTS" -ge 1 ] || die "--requests must be at least 1"
  local s
  SETUP_LIST=()
  IFS=, read -r -a SETUP_LIST <<<"$SETUPS"
  [ "${#SETUP_LIST[@]}" -gt 0 ] || die "--setups is empty"
  for s in "${SETUP_LIST[@]}"; do
    [[ " $KNOWN_SETUPS " == *" $s "* ]] || die "unknown setup '$s' (known: $KNOWN_SETUPS)"
  done
  for s in "${SERVER_ENVS[@]+"${SERVER_ENVS[@]}"}"; do
    [[ $s =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env takes K=V, not '$s'"
  done
  VLLM_ARGS=()
  [ -z "$VLLM_ARGS_STR" ] || read -r -a VLLM_ARGS <<<"$VLLM_ARGS_STR"
  # Two servers on one host need separate ports.
  if [ "$P_ADDR" = "$D_ADDR" ]; then
    [ "$P_PORT" != "$D_PORT" ] || die "P and D on one host ($P_ADDR) need different HTTP ports (--d-port)"
    if [ "$D_SIDE_PORT" -lt $((P_SIDE_PORT + TP)) ] && [ "$P_SIDE_PORT" -lt $((D_SIDE_PORT + TP)) ]; then
      die "P and D on one host ($P_ADDR): side-channel ports $P_SIDE_PORT+$TP and $D_SIDE_PORT+$TP overlap (--d-side-port)"
    fi
  fi
  ROUTER_PORT=${ROUTER_LISTEN##*:}
  is_uint "$ROUTER_PORT" || die "--router-listen must be HOST:PORT, not '$ROUTER_LISTEN'"
  local rhost=${ROUTER_LISTEN%:*}
  [ "$rhost" != 0.0.0.0 ] || rhost=127.0.0.1
  ROUTER_URL="http://$rhost:$ROUTER_PORT"
  if [ -n "$KVPUSH_BIN_OPT" ]; then
    KVPUSH_BIN_PATH=$KVPUSH_BIN_OPT
  elif [ -x "$REPO/target/release/kvpush" ]; then
    KVPUSH_BIN_PATH="$REPO/target/release/kvpush"
  else
    KVPUSH_BIN_PATH=kvpush
  fi
}

# ---------------------------------------------------------------------------------------------------
# Running commands.

# Shell-quotes its arguments into one line that a POSIX shell reads back as the same words.
q() {
  local out="" a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=,+@%^-]+$ ]]; then
      out+="$a "
    else
      out+="'${a//\'/\'\\\'\'}' "
    fi
  done
  printf '%s' "${out% }"
}

say() { printf '[kit] %s\n' "$*"; }

# run CMD...: runs a command on the driver (printed first; with --dry-run only printed).
run() {
  printf '+ %s\n' "$(q "$@")"
  [ "$DRY_RUN" = 1 ] || "$@"
}

# on_host LABEL HOST LINE: runs one line (a call of a remote.sh function, built with q) on HOST
# ("local": on the driver) as `ssh HOST bash -s` fed remote.sh and the line.
on_host() {
  local label=$1 host=$2 line=$3
  printf '+ [%s %s] %s\n' "$label" "$host" "$line"
  [ "$DRY_RUN" = 1 ] && return 0
  if [ "$host" = local ]; then
    { cat "$REMOTE_SH"; printf '%s </dev/null\n' "$line"; } | bash -s
  else
    { cat "$REMOTE_SH"; printf '%s </dev/null\n' "$line"; } | ssh "${SSH_OPTS[@]}" "$host" bash -s
  fi
}

explain_dry_run() {
  if [ "$DRY_RUN" = 1 ]; then
    say "dry run: nothing is run. '+ CMD' runs on this driver; '+ [ROLE HOST] LINE' runs on HOST as"
    say "  ssh $(q "${SSH_OPTS[@]}") HOST bash -s   fed benches/hardware/remote.sh, then LINE"
    say "  ('local' instead of a host: bash -s on this driver)"
  fi
}

# ---------------------------------------------------------------------------------------------------
# Setups: the router's mode, each server's --kv-transfer-config and environment.

setup_mode() {
  case $1 in
    *-push) echo push ;;
    *-pull) echo pull ;;
  esac
}

setup_description() {
  case $1 in
    kvpush-push) echo "kvpush KVPushConnector, push" ;;
    kvpush-pull) echo "kvpush KVPushConnector, pull" ;;
    vllm-push) echo "vLLM NixlPushConnector (push), as shipped" ;;
    vllm-pull) echo "vLLM NixlConnector (pull), as shipped" ;;
  esac
}

engine_id() { [ "$1" = P ] && echo hw-prefill || echo hw-decode; }
kvpush_device() { [ "$PLATFORM" = trn ] && echo neuron || echo cuda; }

# kv_config ROLE SETUP: the --kv-transfer-config JSON of the P or D server of SETUP.
kv_config() {
  local role=$1 setup=$2 kv_role addr side
  if [ "$role" = P ]; then
    kv_role=kv_producer addr=$P_ADDR side=$P_SIDE_PORT
  else
    kv_role=kv_consumer addr=$D_ADDR side=$D_SIDE_PORT
  fi
  case $setup in
    kvpush-*)
      # Keys: docs/vllm.md, "kv_connector_extra_config keys" (python/kvpush/vllm.py DEFAULTS). The KV cache
      # is device memory on both platforms: kv_buffer_device cuda (python/kvpush/_neuron.py for trn).
      printf '{"kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush.vllm", "kv_role": "%s", "kv_buffer_device": "cuda", "engine_id": "%s", "kv_connector_extra_config": {"mode": "%s", "side_channel_host": "%s", "side_channel_port": %s, "nixl_backend": "%s", "device": "%s", "peer_timeout_ms": %s%s}}' \
        "$kv_role" "$(engine_id "$role")" "$(setup_mode "$setup")" "$addr" "$side" "$NIXL_BACKEND" \
        "$(kvpush_device)" "$PEER_TIMEOUT_MS" "${KVPUSH_EXTRA:+, $KVPUSH_EXTRA}"
      ;;
    vllm-push | vllm-pull)
      # vLLM's connectors read the backends list from kv_connector_extra_config["backends"].
      local connector=NixlConnector
      [ "$setup" = vllm-push ] && connector=NixlPushConnector
      printf '{"kv_connector": "%s", "kv_role": "%s", "kv_buffer_device": "%s", "engine_id": "%s", "kv_connector_extra_config": {"backends": ["%s"]}}' \
        "$connector" "$kv_role" "$VLLM_KV_BUFFER_DEVICE" "$(engine_id "$role")" "$NIXL_BACKEND"
      ;;
  esac
}

# server_env ROLE SETUP: prints the server's extra environment, one K=V a line.
server_env() {
  local role=$1 setup=$2 addr side
  if [ "$role" = P ]; then addr=$P_ADDR side=$P_SIDE_PORT; else addr=$D_ADDR side=$D_SIDE_PORT; fi
  case $setup in
    kvpush-*)
      echo "KVPUSH_DEVICE=$(kvpush_device)"
      # Neuron device addresses are only usable with HBM mapped (src/device/neuron.rs).
      [ "$PLATFORM" = trn ] && echo "NEURON_RT_MAP_HBM=1"
      ;;
    vllm-*)
      # vLLM's NIXL side channel listens on (and P advertises) this host and port.
      echo "VLLM_NIXL_SIDE_CHANNEL_HOST=$addr"
      echo "VLLM_NIXL_SIDE_CHANNEL_PORT=$side"
      ;;
  esac
  # P and D on one trn host: libfabric's EFA provider must not hand their transfers to its
  # shared-memory path, which does not carry Neuron device memory.
  [ "$PLATFORM" = trn ] && [ "$P_ADDR" = "$D_ADDR" ] && echo "FI_EFA_ENABLE_SHM_TRANSFER=0"
  local e
  for e in "${SERVER_ENVS[@]+"${SERVER_ENVS[@]}"}"; do echo "$e"; done
}

# server_cmd ROLE SETUP: fills SERVER_CMD with the server's command line.
server_cmd() {
  local role=$1 setup=$2 port=$P_PORT
  [ "$role" = D ] && port=$D_PORT
  local -a envs=()
  mapfile -t envs < <(server_env "$role" "$setup")
  SERVER_CMD=(env ${envs[@]+"${envs[@]}"} "$REMOTE_PY" -m vllm.entrypoints.openai.api_server
    --model "$MODEL" --host 0.0.0.0 --port "$port" --tensor-parallel-size "$TP"
    --max-model-len "$MAX_MODEL_LEN" --kv-transfer-config "$(kv_config "$role" "$setup")")
  # D computes nothing itself: what it did not receive would be prefilled locally and hide a failure.
  [ "$role" = D ] && SERVER_CMD+=(--no-enable-prefix-caching)
  SERVER_CMD+=(${VLLM_ARGS[@]+"${VLLM_ARGS[@]}"})
}

prefill_spec() {
  printf 'http://%s:%s,engine_id=%s,host=%s,port=%s,tp=%s' "$P_ADDR" "$P_PORT" "$(engine_id P)" "$P_ADDR" "$P_SIDE_PORT" "$TP"
}

router_cmd() {
  ROUTER_CMD=("$KVPUSH_BIN_PATH" router --mode "$(setup_mode "$1")" --listen "$ROUTER_LISTEN"
    --prefill "$(prefill_spec)" --decode "http://$D_ADDR:$D_PORT")
}

# ---------------------------------------------------------------------------------------------------
# Checks.

side_ports() {
  local base=$1 i out=""
  for ((i = 0; i < TP; i++)); do out+="$((base + i)) "; done
  printf '%s' "${out% }"
}

setups_need() {
  local prefix=$1 s
  for s in "${SETUP_LIST[@]}"; do [[ $s == "$prefix"* ]] && { echo 1; return; }; done
  echo 0
}

check_host_line() {
  local ports=$1
  local -a args=(kit_check --platform "$PLATFORM" --python "$REMOTE_PY" --backend "$NIXL_BACKEND" --tp "$TP"
    --kvpush "$(setups_need kvpush-)" --vllm-nixl "$(setups_need vllm-)" --ports "$ports")
  local e
  for e in "${SERVER_ENVS[@]+"${SERVER_ENVS[@]}"}"; do args+=(--env "$e"); done
  q "${args[@]}"
}

# run_checks: every prerequisite, on the driver and on both hosts; dies naming what failed.
run_checks() {
  local failed=()
  say "checking prerequisites (--skip-checks skips this)"
  # The driver: the router binary, the client's Python, the router's port.
  if [ "$DRY_RUN" = 1 ]; then
    run "$KVPUSH_BIN_PATH" router --help
    run "$LOCAL_PY" "$CLIENT_PY" check
    on_host driver local "$(q kit_ports_free "$ROUTER_PORT")"
  else
    if ! "$KVPUSH_BIN_PATH" router --help >/dev/null 2>&1; then
      echo "FAIL  driver: '$KVPUSH_BIN_PATH router --help' failed: build it (cargo build --release --bin kvpush) or pass --kvpush-bin"
      failed+=(driver)
    else
      echo "ok    driver: $KVPUSH_BIN_PATH router"
    fi
    "$LOCAL_PY" "$CLIENT_PY" check || failed+=(driver-python)
    on_host driver local "$(q kit_ports_free "$ROUTER_PORT")" || failed+=(driver-port)
  fi
  local p_ports d_ports
  p_ports="$P_PORT $(side_ports "$P_SIDE_PORT")"
  d_ports="$D_PORT $(side_ports "$D_SIDE_PORT")"
  if [ "$P_HOST" = "$D_HOST" ]; then
    on_host P+D "$P_HOST" "$(check_host_line "$p_ports $d_ports")" || failed+=("P+D host $P_HOST")
  else
    on_host P "$P_HOST" "$(check_host_line "$p_ports")" || failed+=("P host $P_HOST")
    on_host D "$D_HOST" "$(check_host_line "$d_ports")" || failed+=("D host $D_HOST")
  fi
  if [ "${#failed[@]}" -gt 0 ]; then
    die "prerequisites not met on: ${failed[*]} (the FAIL lines above say what to fix; docs/deployment.md)"
  fi
  say "prerequisites met"
}

# ---------------------------------------------------------------------------------------------------
# Starting and stopping; every start is recorded first, so the trap stops it whatever happens next.

STARTED=()        # "LABEL|HOST|DIR|NAME", in start order
CLIENT_PID=""

start_on() {
  local label=$1 host=$2 dir=$3 name=$4
  shift 4
  STARTED+=("$label|$host|$dir|$name")
  on_host "$label" "$host" "$(q kit_start "$dir" "$name" "$@")"
}

# Stops everything started, newest first, and forgets it.
stop_started() {
  local i entry label host dir name
  for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do
    entry=${STARTED[$i]}
    IFS='|' read -r label host dir name <<<"$entry"
    on_host "$label" "$host" "$(q kit_stop "$dir" "$name")" || say "could not stop $name on $host (see above)"
  done
  STARTED=()
}

# The trap of every script that starts something: on exit, Ctrl-C or SIGTERM stop the client and
# every server this run started, on both hosts and here.
cleanup() {
  local rc=$?
  trap - EXIT
  # A second Ctrl-C must not cut the clean-up short.
  trap 'say "still stopping what this run started (benches/hardware/stop.sh stops it too)"' INT TERM
  if [ -n "$CLIENT_PID" ] && kill -0 "$CLIENT_PID" 2>/dev/null; then
    say "stopping the client (pid $CLIENT_PID)"
    kill -TERM "$CLIENT_PID" 2>/dev/null || true
    wait "$CLIENT_PID" 2>/dev/null || true
  fi
  if [ "${#STARTED[@]}" -gt 0 ]; then
    say "stopping what this run started"
    stop_started
  fi
  exit "$rc"
}

install_trap() {
  trap cleanup EXIT
  trap 'say "interrupted"; exit 130' INT
  trap 'say "terminated"; exit 143' TERM
}

# wait_http LABEL HOST NAME URL TIMEOUT_S: polls URL until it answers 200; between polls checks that
# NAME still runs on HOST (shows its log's tail and fails if not).
wait_http() {
  local label=$1 host=$2 name=$3 url=$4 timeout=$5
  if [ "$DRY_RUN" = 1 ]; then
    printf '+ poll: curl -s %s until it answers 200 (every %s s, up to %s s); between polls: [%s %s] %s\n' \
      "$url" "$POLL_S" "$timeout" "$label" "$host" "$(q kit_alive "$(dir_of "$host")" "$name")"
    return 0
  fi
  local deadline=$((SECONDS + timeout)) code
  say "waiting for $name at $url (up to $timeout s)"
  while :; do
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$url" || true)
    if [ "$code" = 200 ]; then
      say "$name is ready"
      return 0
    fi
    if ! on_host "$label" "$host" "$(q kit_alive "$(dir_of "$host")" "$name")" >/dev/null; then
      say "$name exited before it was ready; the end of its log:"
      on_host "$label" "$host" "$(q kit_tail "$(dir_of "$host")" "$name" 60)" || true
      return 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "$name did not answer $url with 200 within $timeout s (last: ${code:-no answer}); the end of its log:"
      on_host "$label" "$host" "$(q kit_tail "$(dir_of "$host")" "$name" 60)" || true
      return 1
    fi
    sleep "$POLL_S"
  done
}

dir_of() { [ "$1" = local ] && printf '%s' "$LOCAL_DIR" || printf '%s' "$REMOTE_DIR"; }

# start_servers SETUP: P and D (P first, both in the background), then waits for both.
start_servers() {
  local setup=$1
  server_cmd P "$setup"
  start_on P "$P_HOST" "$REMOTE_DIR" "$setup-P" "${SERVER_CMD[@]}"
  server_cmd D "$setup"
  start_on D "$D_HOST" "$REMOTE_DIR" "$setup-D" "${SERVER_CMD[@]}"
  wait_http P "$P_HOST" "$setup-P" "http://$P_ADDR:$P_PORT/health" "$SERVER_TIMEOUT_S" &&
    wait_http D "$D_HOST" "$setup-D" "http://$D_ADDR:$D_PORT/health" "$SERVER_TIMEOUT_S"
}

start_router() {
  local setup=$1
  router_cmd "$setup"
  start_on router local "$LOCAL_DIR" "$setup-router" "${ROUTER_CMD[@]}"
  wait_http router local "$setup-router" "$ROUTER_URL/health" 120
}

# fetch_logs SETUP DEST: copies the servers' and the router's logs of SETUP into DEST (best effort).
fetch_logs() {
  local setup=$1 dest=$2
  run mkdir -p "$dest"
  run scp -q "${SSH_OPTS[@]}" "$P_HOST:$REMOTE_DIR/logs/$setup-P.log" "$dest/" || say "could not fetch $setup-P.log"
  run scp -q "${SSH_OPTS[@]}" "$D_HOST:$REMOTE_DIR/logs/$setup-D.log" "$dest/" || say "could not fetch $setup-D.log"
  if [ "$DRY_RUN" = 1 ] || [ -f "$LOCAL_DIR/logs/$setup-router.log" ]; then
    run cp "$LOCAL_DIR/logs/$setup-router.log" "$dest/"
  fi
}

json_str() {
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  printf '"%s"' "$s"
}
