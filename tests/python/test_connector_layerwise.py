"""P's connector pushes layer by layer from vLLM's hooks (issue 21), without servers.

The scheduler half puts the requests whose prefill a step completes in that step's metadata (with
chunked prefill, only the step of the last chunk); the worker half, over a fake native worker:

- ``layerwise`` on, KV in host memory: each ``save_kv_layer`` tells the engine at once that the layer
  is final for those requests (``layers_ready``, in layer order, the router's consumer named), and
  ``wait_for_save`` adds only the layers no hook reported — or hands a request whose step ran no hook
  over whole;
- on CUDA, ``save_kv_layer`` only records an event: another thread tells the engine once the event
  completed, and ``wait_for_save`` does not wait for the device (a fake event here: CPU torch has no
  CUDA, so a host synchronisation would raise);
- ``off`` (the default) keeps the whole-request path: hooks do nothing, ``wait_for_save`` hands it over;
- an unknown setting is refused with the list, and layer-wise pull is refused.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

kv = pytest.importorskip("kvpush.vllm", reason="the kvpush package (maturin develop) and vLLM")
import connector_kit as kit  # noqa: E402

TID = "0123456789abcdef0123456789abcdef"
LAYERS = 4


class FakeNative:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def _record(self, *call: Any) -> None:
        with self.lock:
            self.calls.append(call)
            self.threads.add(threading.current_thread().name)

    def layers_ready(self, tid: str, attempt: int, blocks: Any, tokens: int, first: int, end: int, **kw: Any) -> None:
        self._record("layers_ready", tid, first, end, kw.get("consumer_engine_id"))

    def request_finished(self, tid: str, attempt: int, blocks: Any, tokens: int, **kw: Any) -> None:
        self._record("request_finished", tid, kw.get("consumer_engine_id"))


def worker(layerwise: str) -> tuple["kv._Worker", FakeNative]:
    w = kv._Worker(kit.vllm_config("prefill-0"), None, kit.config(layerwise=layerwise))
    w.native = FakeNative()
    w.layer_of = {f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)}
    return w, w.native


def meta() -> "kv.KVPushMetadata":
    f = kv.Finished(req_id="r1", transfer_id=TID, attempt=1, block_ids=[[3, 4]], num_tokens=20, consumer="decode-0")
    return kv.KVPushMetadata(prefilled=[f])


def run_layers(w: "kv._Worker", m: "kv.KVPushMetadata", layers: range) -> None:
    for i in layers:
        w.save_kv_layer(f"model.layers.{i}.self_attn.attn", m)


def test_each_layer_goes_to_the_engine_as_its_hook_runs() -> None:
    w, n = worker("on")
    m = meta()
    run_layers(w, m, range(2))
    assert n.calls == [("layers_ready", TID, 0, 1, "decode-0"), ("layers_ready", TID, 1, 2, "decode-0")]
    run_layers(w, m, range(2, LAYERS))
    w.wait_for_save(m)
    assert n.calls == [("layers_ready", TID, i, i + 1, "decode-0") for i in range(LAYERS)]
    assert n.threads == {threading.current_thread().name}
    # Its outcome ends the request, as a whole-request push's does.
    n.poll = lambda: [("sent", TID, 1, "Sent", [])]
    assert w.get_finished() == ({"r1"}, set())


def test_wait_for_save_reports_the_layers_no_hook_did_and_requests_without_hooks_go_whole() -> None:
    w, n = worker("auto")
    m = meta()
    run_layers(w, m, [0, 2])
    w.wait_for_save(m)
    assert n.calls[2:] == [("layers_ready", TID, 1, 2, "decode-0"), ("layers_ready", TID, 3, 4, "decode-0")]
    n.calls.clear()
    w.wait_for_save(meta())  # a step whose forward ran no attention hook
    assert n.calls == [("request_finished", TID, "decode-0")]


def test_off_keeps_the_whole_request_path() -> None:
    w, n = worker("off")
    m = meta()
    run_layers(w, m, range(LAYERS))
    assert n.calls == []
    w.wait_for_save(m)
    assert n.calls == [("request_finished", TID, "decode-0")]


class FakeEvent:
    """A recorded CUDA event: ``synchronize`` blocks until the test completes it."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(10), "event never completed"


def wait_calls(n: FakeNative, count: int) -> list[tuple[Any, ...]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with n.lock:
            if len(n.calls) >= count:
                return list(n.calls)
        time.sleep(0.005)
    pytest.fail(f"{count} calls expected, got {n.calls}")


def test_on_cuda_a_layer_goes_to_the_engine_once_its_event_completed_off_the_forward_thread() -> None:
    w, n = worker("on")
    w.on_cuda = True
    events: list[FakeEvent] = []
    w._new_event = lambda: events.append(FakeEvent()) or events[-1]
    m = meta()
    run_layers(w, m, range(LAYERS))
    w.wait_for_save(m)  # no host synchronisation: CPU torch would raise on torch.cuda.current_stream()
    assert len(events) == LAYERS
    time.sleep(0.05)
    assert n.calls == [], "a layer went to the engine before its event completed"
    events[0].done.set()
    assert wait_calls(n, 1) == [("layers_ready", TID, 0, 1, "decode-0")]
    time.sleep(0.05)
    assert len(n.calls) == 1, "layer 1 went before its event completed"
    for e in events[1:]:
        e.done.set()
    assert wait_calls(n, LAYERS) == [("layers_ready", TID, i, i + 1, "decode-0") for i in range(LAYERS)]
    assert threading.current_thread().name not in n.threads


@pytest.mark.parametrize("value", ["sometimes", "", 1])
def test_an_unknown_layerwise_setting_is_refused_with_the_list(value: Any) -> None:
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"layerwise": value}, kv_buffer_device="cpu", engine_id="p"
        )
    )
    with pytest.raises(ValueError, match="layerwise must be one of auto, on, off"):
        kv.KVPushConfig.from_vllm(vllm_config)


def test_layerwise_pull_is_refused_and_the_default_is_off() -> None:
    def cfg(extra: dict[str, Any]) -> Any:
        ktc = SimpleNamespace(kv_connector_extra_config=extra, kv_buffer_device="cpu", engine_id="p")
        return kv.KVPushConfig.from_vllm(SimpleNamespace(kv_transfer_config=ktc))

    with pytest.raises(ValueError, match="needs mode 'push'"):
        cfg({"mode": "pull", "layerwise": "on"})
    assert cfg({}).layerwise == "off"
    assert cfg({"layerwise": "AUTO"}).layerwise == "auto"


def scheduler(layerwise: str) -> "kv._Scheduler":
    return kv._Scheduler(kit.vllm_config("prefill-0"), None, kit.config(layerwise=layerwise))


def chunked_steps(req: SimpleNamespace) -> tuple[SimpleNamespace, SimpleNamespace]:
    """A 100-token prompt in two chunks: 64 tokens (blocks 100-103), then 36 (blocks 104-106)."""
    new = SimpleNamespace(
        req_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling_params=SimpleNamespace(max_tokens=1),
        block_ids=([100, 101, 102, 103],), num_computed_tokens=0,
    )  # fmt: skip
    first = SimpleNamespace(
        scheduled_new_reqs=[new], num_scheduled_tokens={req.request_id: 64},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    )  # fmt: skip
    cached = SimpleNamespace(
        req_ids=[req.request_id], resumed_req_ids=set(), new_block_ids=[([104, 105, 106],)], num_computed_tokens=[64]
    )
    second = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={req.request_id: 36}, scheduled_cached_reqs=cached)
    return first, second


@pytest.mark.parametrize("layerwise", ["on", "off"])
def test_a_chunked_prompt_goes_with_its_last_chunk_only(layerwise: str) -> None:
    s = scheduler(layerwise)
    req = SimpleNamespace(
        request_id="r1", kv_transfer_params={"do_remote_decode": True, "transfer_id": TID},
        prompt_token_ids=list(range(100)),
    )  # fmt: skip
    s.get_num_new_matched_tokens(req, 0)
    first, second = chunked_steps(req)
    assert s.build_connector_meta(first).prefilled == []
    last = s.build_connector_meta(second).prefilled
    if layerwise == "off":
        assert last == []  # the whole-request path: request_finished hands it over
        return
    assert [(f.req_id, f.block_ids, f.num_tokens) for f in last] == [("r1", [[100, 101, 102, 103, 104, 105, 106]], 100)]
    assert s.has_pending_block_frees()
    assert s.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})).prefilled == []
