"""Fixtures for the end-to-end tests against real vLLM servers (see servers.py and tiny_model.py).

- ``tiny_model_dir``: the cached tiny Llama's directory (made on first use).
- ``vllm_ready``: checks that the interpreter running the servers imports vLLM, its NIXL connectors and
  NIXL. Without them the test is skipped, except under ``CI=true``, where it fails.
- ``kvpush_bin``: the ``kvpush`` binary (``target/release/kvpush``, built when missing).
- ``servers``: a session-wide factory, ``servers.vllm(name, **kw)`` / ``servers.router(mode, [P], [D])``
  (the arguments of ``start_vllm`` / ``start_router``), ``servers.stop(server)``; everything it started
  is stopped at the end of the session. Server starts take about a minute each: share them across tests
  (module- or session-scoped fixtures built on ``servers``).

When a test fails, the tail of the log of every server and router that was running during it is added
to its report. All logs stay under ``target/pytest-logs/``.

No silent skips under CI (CONTRIBUTING.md, "Tests that can fail"): with ``CI=true``, every skip, in a
test (``pytest.skip``, ``skipif``) or of a whole module (``pytest.importorskip``), is turned into a
failure, except a GPU-presence skip, whose reason starts with ``GPU_SKIP_PREFIX`` ("no GPU"). Outside CI
skips stay skips and are listed by ``-rA``. Every ``xfail`` marker must be ``strict=True`` and name the
exception it expects (``raises=``); a marker that does not is a usage error, CI or not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import servers as srv  # noqa: E402
import tiny_model  # noqa: E402


GPU_SKIP_PREFIX = "no GPU"
"""The only skip allowed under ``CI=true``: ``pytest.skip("no GPU: ...")`` when the machine has none."""


def _skip_reason(longrepr: Any) -> str:
    # A skip's longrepr is (path, lineno, "Skipped: <reason>").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_forbidden_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turns ``report`` into a failure if it is a skip that CI does not allow (an xfail is not a skip)."""
    if not (srv.IN_CI and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report.longrepr)
    if reason.startswith(GPU_SKIP_PREFIX):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true: {reason}\n(only a skip whose reason starts with {GPU_SKIP_PREFIX!r} may pass "
        "in CI; a missing dependency is a failure: see scripts/python.sh)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    # A module-level pytest.importorskip / pytest.skip(allow_module_level=True) skips at collection.
    outcome = yield
    report = outcome.get_result()
    _fail_forbidden_skip(report)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    loose = [
        item.nodeid
        for item in items
        for m in item.iter_markers("xfail")
        if m.kwargs.get("strict") is not True or "raises" not in m.kwargs
    ]
    if loose:
        raise pytest.UsageError(
            "xfail markers must be strict=True and name the exception they expect (raises=...): " + ", ".join(loose)
        )


def _fail_or_skip(reason: str) -> None:
    if srv.IN_CI:
        pytest.fail(f"{reason} (CI=true: a missing dependency is a failure; run scripts/python.sh)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return tiny_model.model_dir()


_CHECK = (
    "import vllm, nixl._api\n"
    "from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector, NixlPushConnector\n"
    "print(vllm.__version__)\n"
)


@pytest.fixture(scope="session")
def vllm_ready() -> str:
    """vLLM's version, once the server interpreter has shown it imports vLLM and NIXL."""
    try:
        r = subprocess.run(
            [srv.vllm_python(), "-c", _CHECK], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        _fail_or_skip(f"cannot run {srv.vllm_python()}: {e}")
    if r.returncode != 0:
        _fail_or_skip(f"vLLM/NIXL not importable by {srv.vllm_python()}: {r.stderr.strip()[-1500:]}")
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def kvpush_bin() -> Path:
    try:
        return srv.router_binary()
    except (srv.ServerError, subprocess.CalledProcessError, OSError) as e:
        _fail_or_skip(f"kvpush binary unavailable: {e}")
        raise


class Servers:
    """Starts servers for tests and stops them all at the end of the session."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.started: list[srv.Server] = []

    def vllm(self, name: str, **kw: Any) -> srv.VllmServer:
        s = srv.start_vllm(name, kw.pop("model_dir", self.model_dir), **kw)
        self.started.append(s)
        return s

    def router(self, mode: str, prefill: list[srv.VllmServer], decode: list[srv.VllmServer], **kw: Any) -> srv.Server:
        s = srv.start_router(mode, prefill, decode, **kw)
        self.started.append(s)
        return s

    def stop(self, *servers: srv.Server) -> None:
        """Stops ``servers``, in the order given."""
        for s in servers:
            s.stop()

    def stop_all(self) -> None:
        for s in reversed(self.started):
            s.stop()


@pytest.fixture(scope="session")
def servers(vllm_ready: str, kvpush_bin: Path, tiny_model_dir: Path):
    pool = Servers(tiny_model_dir)
    yield pool
    pool.stop_all()


def _stop_everything_on_signal(signum: int, frame: Any) -> None:
    srv.stop_all()
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # A pytest killed by SIGTERM (a CI timeout) must not leave servers behind in their own sessions.
    signal.signal(signal.SIGTERM, _stop_everything_on_signal)


def pytest_unconfigure(config: pytest.Config) -> None:
    srv.stop_all()


_TEST_STARTED_AT = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_TEST_STARTED_AT] = time.monotonic()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    _fail_forbidden_skip(report)
    if report.failed and report.when in ("setup", "call"):
        t0 = item.stash.get(_TEST_STARTED_AT, 0.0)
        for s in reversed(srv.STARTED):
            # Servers running during this test, newest first: still up, died on their own, or stopped by it.
            if s.alive() or s.stopped_at is None or s.stopped_at >= t0:
                report.sections.append(
                    (f"{s.name} log tail ({s.log_path})", s.log_tail(int(os.environ.get("KVPUSH_LOG_TAIL", "80"))))
                )
