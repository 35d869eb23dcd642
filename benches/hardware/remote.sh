#!/usr/bin/env bash
# Functions the hardware bench kit runs on the P and D hosts, and on the driver for the router.
#
# The kit does not install anything on the hosts. For each step it feeds this file to `bash -s` (over
# ssh for a host, locally for the router), followed by one line that calls one function, e.g.
#
#   kit_start /tmp/kvpush-hw kvpush-push-P env KVPUSH_DEVICE=neuron ... python3 -m vllm.entrypoints...
#
# (the kit's --dry-run prints exactly those lines). By hand: `bash benches/hardware/remote.sh kit_check
# --platform p5en ...` runs the prerequisite checks of one host on the machine you are on.
#
# kit_start DIR NAME CMD...   start CMD in a new session (its own process group), output to
#                             DIR/logs/NAME.log, pid (= process group id) to DIR/run/NAME.pid
# kit_stop DIR NAME [GRACE_S] SIGTERM to NAME's process group, SIGKILL after GRACE_S (30) seconds
# kit_stop_all DIR            kit_stop for every pid file under DIR/run
# kit_alive DIR NAME          exit status 0 while NAME's process group has a process
# kit_tail DIR NAME [LINES]   the last LINES (40) lines of NAME's log
# kit_mkdir DIR...            mkdir -p
# kit_ports_free PORT...      fails, naming each one, when a port has a TCP listener
# kit_check OPTIONS           the prerequisites of a P or D host (kit_check --help)
#
# Only processes this kit started are ever signalled: the ones recorded in its pid files, by process
# group. Nothing is looked up by name.
set -euo pipefail

kit_start() {
  local dir=$1 name=$2
  shift 2
  mkdir -p "$dir/run" "$dir/logs"
  local pidf="$dir/run/$name.pid" log="$dir/logs/$name.log"
  if [ -f "$pidf" ] && kill -0 -- "-$(cat "$pidf")" 2>/dev/null; then
    echo "kit: $name is already running on $(hostname) (process group $(cat "$pidf")); stop it first (benches/hardware/stop.sh)" >&2
    return 1
  fi
  # setsid: a session and process group of its own (a non-interactive shell's background child is
  # not a group leader, so setsid execs in place and $! is the group id). stdin from /dev/null: this
  # script itself arrives on bash's stdin.
  setsid "$@" >"$log" 2>&1 </dev/null &
  echo "$!" >"$pidf"
  echo "kit: started $name on $(hostname): process group $!, log $log"
}

kit_stop() {
  local dir=$1 name=$2 grace=${3:-30}
  local pidf="$dir/run/$name.pid"
  if [ ! -f "$pidf" ]; then
    echo "kit: $name: no pid file on $(hostname), nothing to stop"
    return 0
  fi
  local pgid
  pgid=$(cat "$pidf")
  if ! [[ $pgid =~ ^[0-9]+$ ]]; then
    echo "kit: $name: pid file $pidf holds '$pgid', not a process id; removed" >&2
    rm -f "$pidf"
    return 0
  fi
  if kill -0 -- "-$pgid" 2>/dev/null; then
    kill -TERM -- "-$pgid" 2>/dev/null || true
    local ticks=0   # of 0.2 s
    while kill -0 -- "-$pgid" 2>/dev/null && [ "$ticks" -lt $((grace * 5)) ]; do
      sleep 0.2
      ticks=$((ticks + 1))
    done
    if kill -0 -- "-$pgid" 2>/dev/null; then
      kill -KILL -- "-$pgid" 2>/dev/null || true
      echo "kit: stopped $name on $(hostname) (process group $pgid: SIGKILL after ${grace} s)"
    else
      echo "kit: stopped $name on $(hostname) (process group $pgid, $((ticks / 5)).$((ticks % 5 * 2)) s after SIGTERM)"
    fi
  else
    echo "kit: $name on $(hostname) had already exited"
  fi
  rm -f "$pidf"
}

kit_stop_all() {
  local dir=$1 pidf found=0
  for pidf in "$dir"/run/*.pid; do
    [ -e "$pidf" ] || continue
    found=1
    kit_stop "$dir" "$(basename "$pidf" .pid)"
  done
  [ "$found" = 1 ] || echo "kit: no pid files under $dir/run on $(hostname)"
}

kit_alive() {
  local pidf="$1/run/$2.pid"
  [ -f "$pidf" ] && kill -0 -- "-$(cat "$pidf")" 2>/dev/null
}

kit_tail() {
  local log="$1/logs/$2.log"
  if [ -f "$log" ]; then
    tail -n "${3:-40}" "$log"
  else
    echo "kit: no log $log on $(hostname)"
  fi
}

kit_mkdir() {
  mkdir -p "$@"
}

kit_ports_free() {
  local port line busy=0
  if ! command -v ss >/dev/null 2>&1; then
    echo "FAIL  ports: 'ss' (iproute2) is missing on $(hostname); cannot check that ports $* are free"
    return 1
  fi
  for port in "$@"; do
    line=$(ss -Hltn "sport = :$port" 2>/dev/null || true)
    if [ -n "$line" ]; then
      echo "FAIL  port $port is in use on $(hostname): $line"
      busy=1
    fi
  done
  [ "$busy" = 0 ] && echo "ok    ports free on $(hostname): $*"
  return "$busy"
}

_kit_check_usage() {
  cat <<'EOF'
kit_check --platform trn|p5en [--python PY] [--backend LIBFABRIC|UCX] [--tp N] [--kvpush 0|1]
          [--vllm-nixl 0|1] [--ports "P1 P2 ..."] [--env K=V]...
Checks one P or D host: EFA (fi_info -p efa; with the LIBFABRIC backend), Neuron devices and libnrt
(trn) or N GPUs (p5en), setsid, vLLM importable by PY, the kvpush wheel (--kvpush 1), vLLM's NIXL
connectors (--vllm-nixl 1), the NIXL backend plugin and its shared libraries, and free ports.
Prints one ok/FAIL line per check; the exit status is the number of failures.
EOF
}

kit_check() {
  local platform="" py=python3 backend=LIBFABRIC tp=8 need_kvpush=1 need_vllm=1 ports=""
  local -a envs=()
  while [ "$#" -gt 0 ]; do
    case $1 in
      --platform) platform=$2; shift 2 ;;
      --python) py=$2; shift 2 ;;
      --backend) backend=$2; shift 2 ;;
      --tp) tp=$2; shift 2 ;;
      --kvpush) need_kvpush=$2; shift 2 ;;
      --vllm-nixl) need_vllm=$2; shift 2 ;;
      --ports) ports=$2; shift 2 ;;
      --env) envs+=("$2"); shift 2 ;;
      -h | --help) _kit_check_usage; return 0 ;;
      *) echo "kit_check: unknown option $1" >&2; _kit_check_usage >&2; return 64 ;;
    esac
  done
  local fails=0 host out tool n
  host=$(hostname)
  echo "== checks on $host (platform $platform, NIXL backend $backend, TP $tp)"
  _ok() { echo "ok    $*"; }
  _bad() { echo "FAIL  $*"; fails=$((fails + 1)); }

  # EFA: libfabric's efa provider must list the instance's EFA devices.
  if [ "$backend" = LIBFABRIC ]; then
    tool=$(command -v fi_info || true)
    [ -n "$tool" ] || { [ -x /opt/amazon/efa/bin/fi_info ] && tool=/opt/amazon/efa/bin/fi_info; } || true
    if [ -z "$tool" ]; then
      _bad "EFA: fi_info not found (PATH, /opt/amazon/efa/bin): install the EFA software (aws-efa-installer) on an EFA-enabled instance (trn1.32xlarge, trn2.48xlarge, p5en.48xlarge) launched with EFA network interfaces"
    elif out=$("$tool" -p efa 2>&1); then
      n=$(grep -c 'provider: efa' <<<"$out" || true)
      _ok "EFA: '$tool -p efa' lists $n efa endpoint(s)"
    else
      _bad "EFA: '$tool -p efa' failed: $(head -n 2 <<<"$out" | tr '\n' ' ')- the instance has no usable EFA device (launch it with EFA interfaces; docs/deployment.md, 'EFA')"
    fi
  else
    echo "info  NIXL backend $backend: EFA not checked (UCX is for InfiniBand/RoCE or a single host)"
  fi

  # The accelerator.
  case $platform in
    trn)
      tool=$(command -v neuron-ls || true)
      [ -n "$tool" ] || { [ -x /opt/aws/neuron/bin/neuron-ls ] && tool=/opt/aws/neuron/bin/neuron-ls; } || true
      if [ -z "$tool" ]; then
        _bad "Neuron: neuron-ls not found (PATH, /opt/aws/neuron/bin): install the Neuron driver and tools (aws-neuronx-dkms, aws-neuronx-tools) or use the Neuron DLAMI"
      elif out=$("$tool" 2>&1); then
        _ok "Neuron: '$tool' answers:"
        printf '      %s\n' "${out//$'\n'/$'\n'      }"
      else
        _bad "Neuron: '$tool' failed: $(head -n 2 <<<"$out" | tr '\n' ' ')"
      fi
      if [ -n "${KVPUSH_LIBNRT:-}" ] && [ -e "$KVPUSH_LIBNRT" ]; then
        _ok "Neuron runtime: KVPUSH_LIBNRT=$KVPUSH_LIBNRT"
      elif [ -e /opt/aws/neuron/lib/libnrt.so.1 ]; then
        _ok "Neuron runtime: /opt/aws/neuron/lib/libnrt.so.1"
      elif ldconfig -p 2>/dev/null | grep -q 'libnrt\.so\.1'; then
        _ok "Neuron runtime: libnrt.so.1 on the loader path"
      else
        _bad "Neuron runtime: no libnrt.so.1 (/opt/aws/neuron/lib, loader path, KVPUSH_LIBNRT): install aws-neuronx-runtime-lib"
      fi
      ;;
    p5en)
      if ! command -v nvidia-smi >/dev/null 2>&1; then
        _bad "GPUs: nvidia-smi not found: install the NVIDIA driver (or use the Deep Learning AMI)"
      elif out=$(nvidia-smi -L 2>&1); then
        n=$(grep -c '^GPU ' <<<"$out" || true)
        if [ "$n" -ge "$tp" ]; then
          _ok "GPUs: nvidia-smi lists $n ($(head -n 1 <<<"$out" | sed 's/ (UUID.*//'))"
        else
          _bad "GPUs: nvidia-smi lists $n, TP $tp needs $tp"
        fi
      else
        _bad "GPUs: 'nvidia-smi -L' failed: $(head -n 2 <<<"$out" | tr '\n' ' ')"
      fi
      ;;
    *) _bad "platform '$platform' is not trn or p5en" ;;
  esac

  if command -v setsid >/dev/null 2>&1; then
    _ok "setsid present"
  else
    _bad "setsid missing (util-linux): the kit starts each server in its own process group with it"
  fi

  # Python: vLLM, kvpush, NIXL and the NIXL backend plugin with all its libraries.
  if ! command -v "$py" >/dev/null 2>&1; then
    _bad "python: '$py' not found on $host: pass the interpreter of the environment that has vLLM (--python)"
  else
    local rc=0
    env ${envs[@]+"${envs[@]}"} "$py" - "$backend" "$need_kvpush" "$need_vllm" <<'PY' || rc=$?
import importlib.metadata as md
import os
import subprocess
import sys

backend, need_kvpush, need_vllm = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
fails = 0


def ok(msg):
    print("ok    " + msg)


def bad(msg):
    global fails
    fails += 1
    print("FAIL  " + msg)


def info(msg):
    print("info  " + msg)


try:
    import vllm

    ok(f"vLLM {vllm.__version__} importable by {sys.executable}")
except Exception as e:
    bad(f"vLLM not importable by {sys.executable}: {e!r} (install vLLM, or on Trainium the Neuron vLLM build, "
        "into this environment, or pass its interpreter with --python)")
if need_vllm:
    # As vLLM resolves --kv-transfer-config's kv_connector: through its connector factory.
    problems = []
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        for name in ("NixlConnector", "NixlPushConnector"):
            try:
                KVConnectorFactory._registry[name]()
            except KeyError:
                problems.append(f"{name}: not a connector this vLLM knows")
            except Exception as e:
                problems.append(f"{name}: {e!r}")
    except Exception as e:
        problems.append(f"vLLM's connector factory: {e!r}")
    if problems:
        bad("vLLM's NIXL connectors (the vllm-push and vllm-pull setups): " + "; ".join(problems))
    else:
        ok("vLLM's NixlConnector and NixlPushConnector load")
    try:
        from vllm.platforms import current_platform

        info(f"vLLM platform '{current_platform.device_type}': NIXL KV buffer devices "
             f"{current_platform.get_nixl_supported_devices() or '(none beyond vLLM defaults)'}")
    except Exception as e:
        info(f"vLLM platform not reported: {e!r}")
if need_kvpush:
    try:
        import kvpush.vllm  # noqa: F401

        ok(f"kvpush {md.version('kvpush')} importable (kvpush.vllm.KVPushConnector)")
    except Exception as e:
        bad(f"kvpush not importable: {e!r} (install the kvpush wheel into this environment: "
            "pip install kvpush-*.whl; docs/deployment.md, 'Install')")
try:
    import nixl._api  # noqa: F401

    ok("nixl Python package importable")
except Exception as e:
    bad(f"nixl not importable: {e!r} (pip install nixl, or NIXL built from source)")

# Where the NIXL plugins are, in the order the kvpush connector looks (python/kvpush/vllm.py _load_nixl).
lib_dirs = []
if os.environ.get("KVPUSH_NIXL_LIB_DIR"):
    lib_dirs.append(os.environ["KVPUSH_NIXL_LIB_DIR"])
for s in [p for p in sys.path if p.endswith("site-packages")]:
    for name in (".nixl_cu13.mesonpy.libs", ".nixl_cu12.mesonpy.libs"):
        lib_dirs.append(os.path.join(s, name))
plugin_dirs = [os.environ["NIXL_PLUGIN_DIR"]] if os.environ.get("NIXL_PLUGIN_DIR") else []
plugin_dirs += [os.path.join(d, "plugins") for d in lib_dirs if os.path.exists(os.path.join(d, "libnixl_capi.so"))]
plugin = next((os.path.join(d, f"libplugin_{backend}.so") for d in plugin_dirs
               if os.path.exists(os.path.join(d, f"libplugin_{backend}.so"))), None)
if plugin is None:
    bad(f"NIXL: no libplugin_{backend}.so in {plugin_dirs or 'any NIXL library directory'} "
        "(set KVPUSH_NIXL_LIB_DIR to the directory of libnixl_capi.so, NIXL_PLUGIN_DIR to its plugins)")
else:
    out = subprocess.run(["ldd", plugin], capture_output=True, text=True).stdout
    missing = sorted({line.split()[0] for line in out.splitlines() if "not found" in line})
    if missing:
        bad(f"NIXL: {plugin} cannot load, missing {', '.join(missing)} (libfabric.so.1: add /opt/amazon/efa/lib "
            "to LD_LIBRARY_PATH with --env; libcuda/libcudart on Trainium: the PyPI nixl wheels' LIBFABRIC "
            "plugin links CUDA, use a NIXL built for the host; docs/deployment.md §3)")
    else:
        ok(f"NIXL: {plugin} and all its libraries load")
sys.exit(min(fails, 100))
PY
    fails=$((fails + rc))
  fi

  if [ -n "$ports" ]; then
    # shellcheck disable=SC2086 # a list of port numbers
    kit_ports_free $ports || fails=$((fails + 1))
  fi
  if [ "$fails" = 0 ]; then
    echo "== $host: all checks passed"
  else
    echo "== $host: $fails check(s) failed"
  fi
  return "$fails"
}

# Run as a script with arguments (by hand): call that function.
if [ "${BASH_SOURCE[0]:-}" = "$0" ] && [ "$#" -gt 0 ]; then
  "$@"
fi
