"""kvpush's figures as vLLM's KV-connector stats and Prometheus metrics, without servers.

The stats object is what vLLM ships from each worker to the front end: these tests aggregate two
workers' figures as vLLM's output aggregator does, read an engine through a fake ``Worker`` (its
``take_transfers`` and ``stats``), and observe the result into Prometheus metrics on a registry of
their own, reading back the samples ``/metrics`` would serve. tests/python/test_metrics_e2e.py reads
them from real vLLM servers.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM")
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvpush import _metrics as m  # noqa: E402


def test_two_workers_aggregate_as_vllm_does() -> None:
    a, b = m.KVPushStats(), m.KVPushStats()
    assert a.is_empty()
    a.observe_transfer(4096, 3, 100, 2000)
    a.record("requests_sent", 1)
    b.observe_transfer(8192, 5, 300, 4000)
    b.record("requests_sent", 1)
    b.record("failures_link", 2)
    # vLLM rebuilds each from its data (build_kv_connector_stats) and aggregates into the first.
    total = m.KVPushStats(data=a.data).aggregate(m.KVPushStats(data=b.data))
    assert total.data["bytes_transferred"] == [4096, 8192]
    assert total.data["num_descriptors"] == [3, 5]
    assert total.data["transfer_duration"] == [0.002, 0.004]
    assert total.data["post_duration"] == [0.0001, 0.0003]
    assert (total.data["requests_sent"], total.data["failures_link"]) == (2, 2)
    r = total.reduce()
    assert r["Num transfers"] == 2 and r["Avg xfer time (ms)"] == 3.0 and r["Avg number of descriptors"] == 4.0
    assert r["Avg MB per transfer"] == round(12288 / 2 / 2**20, 3)
    assert not total.is_empty()
    # A step with only a failure is not empty (vLLM would drop it otherwise).
    only = m.KVPushStats()
    only.record("failures_transfer", 1)
    assert not only.is_empty() and only.reduce() == {"Num transfers": 0, "failures_transfer": 1}


class FakeNative:
    def __init__(self) -> None:
        self.records: list[tuple[int, int, int, int]] = []
        self.failures: dict[str, int] = {}
        self.reads = 0

    def take_transfers(self) -> list[tuple[int, int, int, int]]:
        out, self.records = self.records, []
        return out

    def stats(self) -> dict[str, Any]:
        self.reads += 1
        return {"counters": {}, "failures": dict(self.failures)}


def test_engine_figures_take_each_transfer_once_and_failures_as_growth() -> None:
    native, figures = FakeNative(), m.EngineFigures()
    native.records = [(1000, 2, 50, 700), (2000, 1, 60, 900)]
    native.failures = {"lease_expired": 3, "transfer": 1}
    s = m.KVPushStats()
    figures.collect(native, s, now=10.0)
    assert s.data["bytes_transferred"] == [1000, 2000] and s.data["transfer_duration"] == [0.0007, 0.0009]
    # The counters are totals since the engine started: the first read counts them all...
    assert (s.data["failures_lease_expired"], s.data["failures_transfer"]) == (3, 1)
    # ...later reads only their growth, and not more often than SAMPLE_EVERY_S.
    native.failures = {"lease_expired": 5, "transfer": 1}
    s2 = m.KVPushStats()
    figures.collect(native, s2, now=10.0 + m.SAMPLE_EVERY_S / 2)
    assert s2.is_empty() and native.reads == 1
    figures.collect(native, s2, now=10.0 + m.SAMPLE_EVERY_S)
    assert s2.counts() == {"failures_lease_expired": 2}
    assert s2.num_transfers == 0  # taken once


def prom(registry: CollectorRegistry) -> Any:
    types = {
        Gauge: functools.partial(Gauge, registry=registry),
        Counter: functools.partial(Counter, registry=registry),
        Histogram: functools.partial(Histogram, registry=registry),
    }
    config = SimpleNamespace(kv_transfer_config=None)
    return m.KVPushPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})


def test_prometheus_names_mirror_nixl_and_move() -> None:
    registry = CollectorRegistry()
    metrics = prom(registry)
    labels = {"model_name": "tiny", "engine": "0"}
    get = registry.get_sample_value
    # Present before anything happens (a scrape sees them at 0).
    assert get("vllm:kvpush_bytes_transferred_count", labels) == 0
    assert get("vllm:kvpush_num_failed_transfers_total", labels) == 0
    assert get("vllm:kvpush_failures_total", {**labels, "kind": "lease_expired"}) == 0
    s = m.KVPushStats()
    s.observe_transfer(3 << 20, 7, 120, 4500)
    s.record("requests_sent", 1)
    s.record("failures_transfer", 1)
    s.record("failures_plan", 1)
    s.record("failures_link", 1)
    s.record("failures_lease_expired", 2)
    metrics.observe(s.data, 0)
    assert get("vllm:kvpush_bytes_transferred_count", labels) == 1
    assert get("vllm:kvpush_bytes_transferred_sum", labels) == 3 << 20
    assert get("vllm:kvpush_xfer_time_seconds_sum", labels) == pytest.approx(0.0045)
    assert get("vllm:kvpush_post_time_seconds_sum", labels) == pytest.approx(0.00012)
    assert get("vllm:kvpush_num_descriptors_bucket", {**labels, "le": "10.0"}) == 1
    assert get("vllm:kvpush_requests_sent_total", labels) == 1
    assert get("vllm:kvpush_num_failed_transfers_total", labels) == 2  # transfer + plan
    assert get("vllm:kvpush_num_failed_notifications_total", labels) == 1
    assert get("vllm:kvpush_num_kv_expired_reqs_total", labels) == 2
    assert get("vllm:kvpush_failures_total", {**labels, "kind": "lease_expired"}) == 2
    assert get("vllm:kvpush_failures_total", {**labels, "kind": "remote"}) == 0
