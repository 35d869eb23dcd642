"""D's idle steps (issue 18, docs/vllm.md "Idle steps"), without servers.

While D's only requests wait for their KV, vLLM steps about once a millisecond only to call
``get_finished``. The scheduler half marks a step that schedules no token; on such a step the worker
half of a D that waits for KV blocks in the engine's ``wait`` for at most ``idle_wait_ms`` (a landing
ends it at once). Checked here: when it waits and when it must not (a step that computes, P, nothing
expected, an outcome already there, the setting off), that the real engine's wait ends at once on an
outcome, and that the setting is validated.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

kv = pytest.importorskip("kvpush.vllm", reason="the kvpush package (maturin develop) and vLLM")
import connector_kit as kit  # noqa: E402

TID = "0123456789abcdef0123456789abcdef"


class WaitingNative:
    """Records the worker half's waits; ``poll`` returns what a test queued."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.outcomes: list[tuple[str, str, int, str, list[list[int]]]] = []

    def blocks_allocated(self, *args: Any) -> None:
        pass

    def request_finished(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        return bool(self.outcomes)

    def poll(self) -> list[tuple[str, str, int, str, list[list[int]]]]:
        out, self.outcomes = self.outcomes, []
        return out


def d_worker(**cfg: Any) -> tuple["kv._Worker", WaitingNative]:
    w = kv._Worker(kit.vllm_config("decode-0"), None, kit.config(**cfg))
    native = WaitingNative()
    w.native = native
    return w, native


def receive(rid: str = "d1", tid: str = TID) -> "kv.Receive":
    return kv.Receive(
        req_id=rid, transfer_id=tid, attempt=1, producer="prefill-0", host="127.0.0.1", port=5600,
        producer_tp=1, block_ids=[[3, 4]], num_tokens=32,
    )  # fmt: skip


def test_the_scheduler_half_marks_only_steps_that_schedule_no_token_idle() -> None:
    s = kv._Scheduler(kit.vllm_config("decode-0"), None, kit.config())
    out = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    assert s.build_connector_meta(out).idle is True
    out = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={"r": 1}, total_num_scheduled_tokens=1)
    assert s.build_connector_meta(out).idle is False
    # An object without the count (not vLLM's) is never taken for idle.
    assert s.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})).idle is False


def test_d_waits_on_an_idle_step_only_while_it_expects_kv() -> None:
    w, native = d_worker(idle_wait_ms=4.0)
    idle = kv.KVPushMetadata(idle=True)
    # Nothing expected yet: no wait.
    assert w.idle_wait(idle) is False
    w.start_load_kv(kv.KVPushMetadata(receives=[receive()]))
    # A step that computes: no wait. No metadata bound: no wait.
    assert w.idle_wait(kv.KVPushMetadata(idle=False)) is False
    assert w.idle_wait(None) is False
    assert native.waits == []
    # Idle while the KV is expected: one wait of idle_wait_ms.
    assert w.idle_wait(idle) is True
    assert native.waits == [pytest.approx(0.004)]
    # The KV lands: reported, and nothing is expected any more, so the next idle step does not wait.
    native.outcomes = [("received", TID, 1, "", [])]
    assert w.get_finished() == (set(), {"d1"})
    assert w.idle_wait(idle) is False
    assert len(native.waits) == 1


def test_no_wait_when_switched_off_or_for_a_producer() -> None:
    w, native = d_worker(idle_wait_ms=0.0)
    w.start_load_kv(kv.KVPushMetadata(receives=[receive()]))
    assert w.idle_wait(kv.KVPushMetadata(idle=True)) is False
    # P holding blocks for D: a new prompt must not queue behind its report, so P never waits.
    p, p_native = d_worker(idle_wait_ms=4.0)
    p.native = p_native
    p.wait_for_save(kv.KVPushMetadata(prefilled=[kv.Finished("p1", TID, 1, [[1, 2]], 32)]))
    assert p.outcomes.expects("p") and not p.outcomes.expects("d")
    assert p.idle_wait(kv.KVPushMetadata(idle=True)) is False
    assert (native.waits, p_native.waits) == ([], [])


@pytest.mark.parametrize("bad", [-1, 101, "4", True, None, float("nan")])
def test_idle_wait_ms_is_validated(bad: Any) -> None:
    ktc = SimpleNamespace(
        kv_connector_extra_config={"idle_wait_ms": bad}, kv_buffer_device="cpu", engine_id="decode-0"
    )
    with pytest.raises(ValueError, match="idle_wait_ms"):
        kv.KVPushConfig.from_vllm(SimpleNamespace(kv_transfer_config=ktc))


def test_the_engines_wait_times_out_then_ends_at_once_on_an_outcome() -> None:
    # The real engine over host memory: P holds a finished request's blocks for a D that never comes.
    from test_native_stats import host_worker

    native = pytest.importorskip("kvpush._native", reason="the native module (maturin develop)")
    worker, _buf = host_worker("idle-wait-test")
    worker.request_finished(TID, 1, [[0, 1]], 32)
    t0 = time.monotonic()
    assert worker.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.045
    with pytest.raises(native.ConfigError, match="timeout_s"):
        worker.wait(-1.0)
    # The abort's outcome ("sent": the blocks are free) comes from a writer thread: the wait, far
    # longer than the test may take, ends as soon as it is there.
    worker.abort(TID, 1)
    t0 = time.monotonic()
    assert worker.wait(30.0) is True
    assert time.monotonic() - t0 < 10.0
    assert [o[0] for o in worker.poll()] == ["sent"]
    assert worker.wait(0.0) is False
