"""The connector's worker half inside a harness shaped like vllm-neuron 0.24 (tests/python/neuron_harness.py),
with the fake libnrt as the Neuron runtime: push and pull, every byte verified. No vLLM server, no Trainium.

The framework (the harness) sets NEURON_RT_VISIBLE_CORES and NEURON_RT_MAP_HBM=1, starts the runtime,
allocates one KV tensor per layer on device ``neuron`` and calls ``register_kv_caches``; the connector must
see the cache as Neuron memory (engine device ``neuron``, NIXL backend LIBFABRIC by default,
``kv_buffer_device`` ``cuda``), and the engine must accept the tensors' addresses through libnrt alone.
The bytes move through the engine's loopback transport: NIXL cannot register Neuron memory on this CPU
machine (UCX refuses device memory without CUDA; LIBFABRIC does not load: docs/deployment.md §3), so the
harness hands the native worker the connector's config with ``transport: loopback`` and nothing else changed.

Under CI=true a missing prerequisite (vLLM, the kvpush package, a C compiler) fails; elsewhere it skips.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import neuron_harness as nh

CI = os.environ.get("CI", "").lower() in ("true", "1")


def _missing(what: str, why: object) -> None:
    if CI:
        pytest.fail(f"{what} is required under CI: {why}")
    pytest.skip(f"{what}: {why}", allow_module_level=True)


try:
    import kvpush
    import kvpush.vllm as kvv
    from kvpush import _native
except ImportError as e:  # pragma: no cover - depends on the machine
    _missing("the kvpush package (maturin develop) and vLLM", e)

MODEL = nh.Model()
CORE = 0


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[nh.Runtime]:
    """vllm-neuron's steps 1 and 3: the environment, then the runtime, before any KV transfer."""
    try:
        lib = nh.build_fake(tmp_path_factory.mktemp("fake-nrt"))
    except (OSError, FileNotFoundError) as e:
        _missing("a C compiler for the fake libnrt", e)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEURON_RT_VISIBLE_CORES", str(CORE))
        mp.setenv("NEURON_RT_MAP_HBM", "1")
        mp.setenv("KVPUSH_LIBNRT", str(lib))  # the engine loads the framework's libnrt: one runtime
        mp.delenv("KVPUSH_NEURON_RUNTIME", raising=False)
        mp.delenv("KVPUSH_NEURON_CORE", raising=False)
        rt = nh.Runtime(lib)
        rt.initialize()
        yield rt
        rt.close()


class Native:
    """Records the config the connector builds and starts the real native worker with it, on the
    loopback transport (see the module docs)."""

    def __init__(self, hub: str):
        self.hub, self.configs, self.workers = hub, [], []

    def __call__(self, config: dict[str, Any]) -> Any:
        self.configs.append(dict(config))
        w = _native.Worker({**config, "transport": "loopback", "hub": self.hub})
        self.workers.append(w)
        return w


def start_worker(runtime: nh.Runtime, monkeypatch: pytest.MonkeyPatch, native: Native, engine_id: str,
                 mode: str, **extra: Any) -> tuple[Any, dict[str, nh.NeuronTensor]]:  # fmt: skip
    """vllm-neuron's steps 2, 4 and 5 for one worker: its KV cache and the connector's worker half."""
    nh.single_rank(monkeypatch)
    monkeypatch.setattr(kvpush, "Worker", native)
    kv_caches = nh.allocate_kv_caches(runtime, MODEL, CORE, engine_id)
    config = {"mode": mode, "side_channel_port": 0, "side_channel_listen": "127.0.0.1", "secret": "harness"}
    config.update(extra)
    vcfg = nh.vllm_config(MODEL, engine_id, config)
    worker = kvv._Worker(vcfg, nh.kv_cache_config(MODEL), kvv.KVPushConfig.from_vllm(vcfg))
    worker.register_kv_caches(kv_caches)
    return worker, kv_caches


def fill(kv: dict[str, nh.NeuronTensor], req: int, blocks: list[int]) -> None:
    """The forward pass writing a request's KV (K and V of every layer, every listed block)."""
    for layer in range(MODEL.layers):
        t = kv[MODEL.layer_name(layer)].host_view()
        for i, b in enumerate(blocks):
            for part in (0, 1):
                t[part, b].view(torch.uint8).copy_(nh.pattern(req, layer, part, i, t[part, b].view(torch.uint8).shape))


def verify(kv: dict[str, nh.NeuronTensor], req: int, blocks: list[int], tokens: int) -> int:
    """Checks every byte of the request's valid tokens on D; returns the bytes checked."""
    checked = 0
    for layer in range(MODEL.layers):
        t = kv[MODEL.layer_name(layer)].host_view()
        for i, b in enumerate(blocks):
            valid = min(MODEL.block_size, tokens - i * MODEL.block_size)
            for part in (0, 1):
                got = t[part, b].view(torch.uint8)  # (heads, block_size, head_dim·elem)
                want = nh.pattern(req, layer, part, i, got.shape)
                assert torch.equal(got[:, :valid], want[:, :valid]), f"request {req} layer {layer} part {part} block {b}"
                checked += got[:, :valid].numel()
    return checked


def finished(worker: Any, want: str, deadline_s: float = 20.0) -> tuple[set[str], set[str]]:
    """Polls ``get_finished`` (as vLLM does every step) until ``want`` is reported."""
    import time

    sending: set[str] = set()
    recving: set[str] = set()
    end = time.monotonic() + deadline_s
    while want not in sending | recving:
        s, r = worker.get_finished()
        sending |= s
        recving |= r
        assert time.monotonic() < end, f"{want} not reported within {deadline_s} s"
        time.sleep(0.005)
    return sending, recving


def test_the_connector_sees_neuron_memory_as_vllm_neuron_lays_it_out(
    runtime: nh.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    native = Native(f"layout-{uuid.uuid4().hex}")
    worker, kv = start_worker(runtime, monkeypatch, native, "neuron-layout", "push")
    (config,) = native.configs
    # Neuron defaults: the engine's neuron device, LIBFABRIC (UCX has no Neuron memory type).
    assert (config["device"], config["nixl_backend"]) == ("neuron", "LIBFABRIC")
    # (2, blocks, heads, block_size, head_dim): K and V regions per layer, head-major.
    assert (config["placement"], config["order"], config["kv_heads"], config["head_dim"]) == ("separate", "hnd", 2, 16)
    assert (config["block_tokens"], config["num_blocks"], config["dtype"]) == (32, MODEL.blocks, "bfloat16")
    bases = [kv[MODEL.layer_name(i)][p].data_ptr() for i in range(MODEL.layers) for p in (0, 1)]
    assert config["region_bases"] == bases, "each layer's K and V at its device address"
    assert worker.native.side_channel_port is None, "loopback: no side channel"
    # The engine validated the framework's addresses through libnrt (it never saw a tensor handle).
    assert runtime.counter("dmabuf_calls") >= len(bases)


def test_kv_buffer_device_cpu_is_refused_on_neuron(runtime: nh.Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    nh.single_rank(monkeypatch)
    monkeypatch.setattr(kvpush, "Worker", Native(f"refused-{uuid.uuid4().hex}"))
    kv_caches = nh.allocate_kv_caches(runtime, MODEL, CORE, "neuron-cpu-buffer")
    vcfg = nh.vllm_config(MODEL, "neuron-cpu-buffer", {"secret": "harness"}, kv_buffer_device="cpu")
    worker = kvv._Worker(vcfg, nh.kv_cache_config(MODEL), kvv.KVPushConfig.from_vllm(vcfg))
    with pytest.raises(ValueError, match="set kv_buffer_device to 'cuda', which on Neuron means device memory"):
        worker.register_kv_caches(kv_caches)


def test_framework_memory_the_runtime_does_not_map_is_refused(
    runtime: nh.Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host tensor claimed as Neuron memory: the engine asks libnrt and refuses it at start-up."""
    nh.single_rank(monkeypatch)
    monkeypatch.setattr(kvpush, "Worker", Native(f"host-{uuid.uuid4().hex}"))
    host = {MODEL.layer_name(i): nh.NeuronTensor(torch.zeros(MODEL.shape(), dtype=MODEL.dtype), CORE)
            for i in range(MODEL.layers)}  # fmt: skip
    vcfg = nh.vllm_config(MODEL, "neuron-host", {"secret": "harness"})
    worker = kvv._Worker(vcfg, nh.kv_cache_config(MODEL), kvv.KVPushConfig.from_vllm(vcfg))
    with pytest.raises(kvpush.KvpushError, match="libnrt does not map it as Neuron device memory"):
        worker.register_kv_caches(host)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_push_and_pull_between_vllm_neuron_workers(
    runtime: nh.Runtime, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    native = Native(f"{mode}-{uuid.uuid4().hex}")
    p, p_kv = start_worker(runtime, monkeypatch, native, f"prefill-{mode}", mode)
    d, d_kv = start_worker(runtime, monkeypatch, native, f"decode-{mode}", mode)
    d.native.connect(p.native)  # what D's first request would dial over the side channel
    total = 0
    requests = [(1, 70, [0, 3, 4]), (2, 32, [7]), (3, 1, [9])]  # (request, tokens, P's blocks)
    for req, tokens, p_blocks in requests:
        d_blocks = [MODEL.blocks - 1 - b for b in p_blocks]
        fill(p_kv, req, p_blocks)
        tid = uuid.uuid4().hex
        p_req, d_req = f"p-{mode}-{req}", f"d-{mode}-{req}"
        # The scheduler halves' metadata, as P's and D's schedulers build it.
        p.start_load_kv(kvv.KVPushMetadata(finished=[kvv.Finished(p_req, tid, 1, [p_blocks], tokens)]))
        remote = [p_blocks] if mode == "pull" else None
        receive = kvv.Receive(d_req, tid, 1, f"prefill-{mode}", "127.0.0.1", 0, 1, [d_blocks], tokens, remote)
        d.start_load_kv(kvv.KVPushMetadata(receives=[receive]))
        _, recving = finished(d, d_req)
        assert d_req in recving and not d.get_block_ids_with_load_errors(), f"request {req} failed"
        finished(p, p_req)
        total += verify(d_kv, req, d_blocks, tokens)
    assert d.stats.data.get("requests_received") == len(requests)
    elem = torch.empty((), dtype=MODEL.dtype).element_size()
    want = sum(tokens for _, tokens, _ in requests) * MODEL.layers * 2 * MODEL.kv_heads * MODEL.head_dim * elem
    assert total == want, "every valid token of every layer's K and V was checked"
