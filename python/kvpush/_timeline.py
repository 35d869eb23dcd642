"""The connector's part of a request's timeline (docs/benchmarks.md, "Time to first token").

With ``KVPUSH_TIMELINE`` set to a directory, the connector appends one JSON line per event —
``{"ns": <CLOCK_REALTIME ns>, "ev": "p_…"|"d_…", "tid": "<32 hex>", "attempt": N, "pid": P}`` — to
``<dir>/vllm-<pid>.jsonl``; the engine (``engine-<pid>.jsonl``) and ``kvpush router``
(``router-<pid>.jsonl``) write theirs beside it, and ``python -m kvpush.timeline DIR`` puts them together.
Off, every call returns after one test. It never raises into vLLM: a line that cannot be written is
dropped.

Events recorded here (the scheduler's and the worker's halves of the connector):

- ``p_sched`` / ``d_sched``: the scheduler first looks at the request (``get_num_new_matched_tokens``);
- ``d_alloc``: D allocated its blocks (``update_state_after_alloc``);
- ``p_finished``: P's prefill ended (``request_finished``);
- ``p_release`` / ``d_register``: the worker hands the request to the engine (``start_load_kv``);
- ``p_reported`` / ``d_reported``: ``get_finished`` reports the engine's outcome to vLLM;
- ``d_kv_ready``: D's scheduler learns the KV landed (``update_connector_output``);
- ``d_scheduled``: D schedules the request's remaining prompt token (the step that samples the first
  token);
- ``d_token_step``: D schedules the request's next step (its second token; with vLLM's asynchronous
  scheduling this can precede the first token's way out of the engine core: ``router_first_byte`` is
  when the client gets it).

The router's (router/src/timeline.rs): ``router_recv``, ``router_p_sent``, ``router_d_sent``,
``router_d_head`` (D's response head), ``router_p_done`` (P's whole answer), ``router_p_token`` (P's
token sent as the client's first, docs/router.md), ``router_first_byte`` (the first data sent to the
client: P's token, or D's first data). The engine's (src/engine/timeline.rs, recorded by its writer threads
unless named otherwise): ``eng_register_sent`` (D), ``eng_registration_read`` (P's side-channel reader
decoded it), ``eng_registration_recv``, ``eng_blocks_ready``, ``eng_rendezvous`` (P), ``eng_write_post`` /
``eng_read_post``, ``eng_write_done`` / ``eng_read_done``, ``eng_grant_recv`` (D, pull),
``eng_notified`` (D, push), ``eng_received`` (D), ``eng_released`` (P).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, TextIO

ENV = "KVPUSH_TIMELINE"

_lock = threading.Lock()
_file: TextIO | None = None
_opened = False


def _sink() -> TextIO | None:
    global _file, _opened
    if _opened:
        return _file
    with _lock:
        if not _opened:
            d = os.environ.get(ENV)
            if d:
                try:
                    os.makedirs(d, exist_ok=True)
                    _file = open(os.path.join(d, f"vllm-{os.getpid()}.jsonl"), "a", buffering=1)
                except OSError:
                    _file = None
            _opened = True
    return _file


def enabled() -> bool:
    return _sink() is not None


def record(event: str, tid: str, attempt: int = 1) -> None:
    """Records ``event`` of transfer ``tid`` now, when the timeline is on."""
    f = _sink()
    if f is None:
        return
    line = json.dumps({"ns": time.time_ns(), "ev": event, "tid": tid, "attempt": attempt, "pid": os.getpid()})
    try:
        with _lock:
            f.write(line + "\n")
    except (OSError, ValueError):
        pass


def scheduler_saw(params: dict[str, Any] | None) -> None:
    """Records ``p_sched`` or ``d_sched`` for a request carrying a transfer id (never raises)."""
    if not params or "transfer_id" not in params:
        return
    if params.get("do_remote_prefill"):
        event = "d_sched"
    elif params.get("do_remote_decode"):
        event = "p_sched"
    else:
        return
    try:
        record(event, str(params["transfer_id"]).lower(), int(params.get("attempt", 1)))
    except (TypeError, ValueError):
        pass


class SchedulerTrack:
    """D's scheduler: which scheduled requests are transfers, to record when they are scheduled again."""

    def __init__(self) -> None:
        self.on = enabled()
        # req_id -> (transfer id, attempt, the next event to record for it)
        self.reqs: dict[str, tuple[str, int, str]] = {}

    def kv_ready(self, req_id: str, transfer: tuple[str, int] | None) -> None:
        if self.on and transfer is not None:
            record("d_kv_ready", *transfer)
            self.reqs[req_id] = (transfer[0], transfer[1], "d_scheduled")

    def step(self, scheduler_output: Any) -> None:
        """Records ``d_scheduled`` / ``d_token_step`` for the tracked requests this step schedules."""
        if not self.on or not self.reqs:
            return
        ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        ids += list(scheduler_output.scheduled_cached_reqs.req_ids)
        for rid in ids:
            entry = self.reqs.get(rid)
            if entry is None:
                continue
            tid, attempt, event = entry
            record(event, tid, attempt)
            if event == "d_scheduled":
                self.reqs[rid] = (tid, attempt, "d_token_step")
            else:
                del self.reqs[rid]

    def forget(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)
