"""D dials only the producers its allow-list names (docs/security.md, "Which producers D dials"),
whatever host a request's kv_transfer_params give: without servers, a native worker asked to register
with a producer off the list fails the request with the list in the message, and opens no connection
(a tripwire listener on the named address sees none); the same request on a worker that allows the
address does reach it."""

from __future__ import annotations

import ctypes
import socket
import time

import pytest
from host_worker import block_bytes, host_config

kvpush = pytest.importorskip("kvpush", reason="the kvpush package (maturin develop)")
kv = pytest.importorskip("kvpush.vllm", reason="the kvpush package (maturin develop) and vLLM")

SHAPE = dict(layers=2, blocks=4, block_tokens=16, head_dim=8)
TID = "00000000000000000000000000abcdef"


def worker(engine_id: str, dial_allow: str | None, buf: ctypes.Array) -> object:
    return kvpush.Worker(host_config(engine_id, buf, dial_allow=dial_allow, **SHAPE))


def memory() -> ctypes.Array:
    return ctypes.create_string_buffer(SHAPE["layers"] * SHAPE["blocks"] * block_bytes(SHAPE["block_tokens"], SHAPE["head_dim"]))


def failure(w: object, seconds: float = 10.0) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for kind, tid, _attempt, message, _invalid in w.poll():
            if tid == TID:
                assert kind == "failed", (kind, message)
                return message
        time.sleep(0.01)
    raise AssertionError(f"no outcome for {TID} within {seconds} s")


def accepted(trip: socket.socket, seconds: float) -> bool:
    trip.settimeout(seconds)
    try:
        conn, _ = trip.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


def test_a_request_naming_a_producer_off_the_list_is_failed_without_a_dial() -> None:
    buf = memory()
    trip = socket.socket()
    trip.bind(("127.0.0.1", 0))
    trip.listen(8)
    port = trip.getsockname()[1]

    off = worker("decode-off", "10.0.0.0/8", buf)
    off.blocks_allocated(TID, 1, "prefill", "127.0.0.1", port, 1, [[0, 1]], 20)
    message = failure(off)
    assert "dial allow-list (10.0.0.0/8) does not include it" in message, message
    assert "KVPUSH_DIAL_ALLOW" in message, message
    # The failure came before any socket: nothing waits in the tripwire's queue.
    assert not accepted(trip, 0.2), "a refused dial reached the producer's address"

    # The same request on a worker whose list has loopback does dial (the tripwire speaks no side
    # channel, so it then fails at the handshake: what matters is that the connection arrived).
    on = worker("decode-on", "127.0.0.0/8", buf)
    on.blocks_allocated(TID, 1, "prefill", "127.0.0.1", port, 1, [[0, 1]], 20)
    assert accepted(trip, 10.0), "an allowed dial never arrived"


@pytest.mark.parametrize(
    ("given", "passed"),
    [(None, None), ("10.0.0.0/8", "10.0.0.0/8"), (["10.1.0.0/16", "prefill-0.svc"], "10.1.0.0/16,prefill-0.svc")],
)
def test_the_connector_passes_the_list_to_the_engine(given: object, passed: str | None) -> None:
    assert kv._dial_allow(given) == passed


def test_a_malformed_list_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="dial_allow must be a list"):
        kv._dial_allow(5)
    buf = memory()
    with pytest.raises(kvpush.ConfigError, match=r"dial allow-list entry \"10.0.0.0/33\""):
        worker("decode-bad", "10.0.0.0/33", buf)
