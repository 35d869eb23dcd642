"""servers.py's port handling, against a fake vLLM server (seconds, no vLLM needed).

- A vLLM server whose picked port (HTTP or side channel) was taken before it bound it exits saying so;
  ``start_vllm`` starts it again on fresh ports, and its ``--kv-transfer-config`` (a function of the
  side-channel port) follows. A port the caller fixed is not replaced: the error stands.
- ``start_router`` without a port has the router listen on port 0 and reads the port it got from its log.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Iterator

import pytest
import requests

import servers as srv

# Stands in for `python -m vllm.entrypoints.openai.api_server`: binds --port and the side-channel port
# (VLLM_NIXL_SIDE_CHANNEL_PORT) as vLLM does, failing the way Python does when one is taken, then
# answers every GET with 200 (/v1/models, /health; /v1/kvpush/info says pull mode).
FAKE_VLLM = r'''
import json, os, socket, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
side = socket.socket()
side.bind(("127.0.0.1", int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"])))  # OSError: Address already in use
side.listen()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"mode": "pull"} if self.path == "/v1/kvpush/info" else {"data": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
print("INFO:     Application startup complete.", flush=True)
http.serve_forever()
'''


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "fake-python"
    exe.write_text(f"#!{sys.executable}\n" + FAKE_VLLM)
    exe.chmod(0o755)
    monkeypatch.setenv("KVPUSH_VLLM_PYTHON", str(exe))
    return tmp_path


@pytest.fixture
def taken() -> Iterator[int]:
    """A port someone else is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def picks_first(monkeypatch: pytest.MonkeyPatch, ports: list[int | None]) -> None:
    """``free_port`` answers ``ports`` in order (``None``: a real pick), then real picks."""
    real, queue = srv.free_port, list(ports)

    def pick(avoid=()):
        p = queue.pop(0) if queue else None
        return p if p is not None else real(avoid)

    monkeypatch.setattr(srv, "free_port", pick)


def kv_config(port: int) -> dict:
    return {"kv_role": "kv_producer", "engine_id": "fake", "kv_connector_extra_config": {"side_channel_port": port}}


@pytest.mark.parametrize("which", ["http", "side channel"])
def test_a_picked_port_taken_before_the_server_bound_it_is_replaced(
    fake_vllm: Path, taken: int, monkeypatch: pytest.MonkeyPatch, which: str
) -> None:
    picks_first(monkeypatch, [taken] if which == "http" else [None, taken])
    s = srv.start_vllm("fake", fake_vllm, kv_transfer_config=kv_config, warm_up=False, log_dir=fake_vllm)
    try:
        first, *rest = [x for x in srv.STARTED if x.log_path.parent == fake_vllm]
        assert first is not s and rest == [s], "one failed start, then the one returned"
        assert first.proc.poll() not in (None, 0), "the first start exited with an error"
        assert "Address already in use" in first.log_path.read_text(), first.log_tail()
        assert taken in (first.port, first.side_channel_port)
        assert taken not in (s.port, s.side_channel_port)
        assert requests.get(s.url + "/v1/models", timeout=10).status_code == 200
        # The config went with the port the server got.
        assert s.kv_transfer_config == kv_config(s.side_channel_port)
        assert s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(s.side_channel_port)
    finally:
        s.stop()


def test_a_port_the_caller_fixed_is_not_replaced(fake_vllm: Path, taken: int) -> None:
    with pytest.raises(srv.ServerError, match="Address already in use"):
        srv.start_vllm("fixed", fake_vllm, port=taken, warm_up=False, log_dir=fake_vllm)
    assert [x.port for x in srv.STARTED if x.log_path.parent == fake_vllm] == [taken], "started once"


def test_the_router_listens_on_port_zero_and_says_where(fake_vllm: Path, kvpush_bin: Path) -> None:
    p = srv.start_vllm("fake-p", fake_vllm, warm_up=False, log_dir=fake_vllm)
    d = srv.start_vllm("fake-d", fake_vllm, warm_up=False, log_dir=fake_vllm)
    try:
        with srv.start_router("pull", [p], [d], log_dir=fake_vllm) as r:
            assert r.argv[r.argv.index("--listen") + 1] == "127.0.0.1:0"
            assert r.port not in (0, p.port, d.port) and r.url == f"http://127.0.0.1:{r.port}"
            assert requests.get(r.url + "/health", timeout=10).status_code == 200
    finally:
        p.stop()
        d.stop()
