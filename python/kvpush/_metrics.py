"""kvpush's figures as vLLM KV-connector stats and Prometheus metrics (``vllm:kvpush_*``).

vLLM collects a connector's stats every engine step: each worker's ``get_kv_connector_stats()`` (a
:class:`KVPushStats`) is aggregated over the workers of the server (TP and PP ranks) with
``aggregate``, its ``data`` goes to the front end, which rebuilds it with ``build_kv_connector_stats``,
accumulates it for the periodic log line (``reduce``) and hands the same data to
:class:`KVPushPromMetrics`, which turns it into Prometheus observations — served on vLLM's
``/metrics`` — named after ``vllm:nixl_*``, the metrics of vLLM's own NIXL connector.

A worker's figures come from its engine, through :class:`EngineFigures`: one observation per transfer
the engine finished (bytes, descriptors, the time to post it and the time from post to completion),
and what the engine's failure counters grew by since they were last read. The connector adds its own
request counters. docs/vllm.md lists every metric and how it adds up across ranks.

Nothing here raises into vLLM: a worker whose engine cannot be read reports nothing for that step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# Per-transfer observations (lists, concatenated across ranks and steps).
OBSERVED = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors")
# The connector's request counters.
REQUESTS = (
    "requests_registered",
    "requests_sent",
    "requests_received",
    "requests_failed",
    "requests_dropped",
    "requests_quarantined",
    "requests_released",
)
# The engine's failure counters (``failures`` of ``Worker.stats()``, src/engine/stats.rs) published by kind.
FAILURE_KINDS = ("post", "transfer", "plan", "lease_expired", "timeout", "remote", "malformed", "unknown_peer", "link")
# How often a worker reads its engine's counters (the per-transfer records are taken every step).
SAMPLE_EVERY_S = 0.25


def _failure_key(kind: str) -> str:
    return f"failures_{kind}"


@dataclass
class KVPushStats(KVConnectorStats):
    """Observations and counts since the last collection (see the module docs). ``data`` holds
    :data:`OBSERVED` as lists and every count as an int; it is what vLLM serializes."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {k: [] for k in OBSERVED}

    def record(self, key: str, value: int | float) -> None:
        """Adds ``value`` to counter ``key``."""
        self.data[key] = self.data.get(key, 0) + value

    def observe_transfer(self, bytes_: int, descriptors: int, post_us: int, transfer_us: int) -> None:
        """One transfer the engine finished (times in µs, kept in seconds as vLLM's NIXL stats do)."""
        for key in OBSERVED:
            self.data.setdefault(key, [])
        self.data["transfer_duration"].append(transfer_us / 1e6)
        self.data["post_duration"].append(post_us / 1e6)
        self.data["bytes_transferred"].append(bytes_)
        self.data["num_descriptors"].append(descriptors)

    @property
    def num_transfers(self) -> int:
        return len(self.data.get("transfer_duration", ()))

    def counts(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def is_empty(self) -> bool:
        return self.num_transfers == 0 and not any(self.counts().values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, list):
                self.data.setdefault(k, []).extend(v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {"Num transfers": self.num_transfers}
        if self.num_transfers:
            xfer = sorted(self.data["transfer_duration"])
            post = self.data["post_duration"]
            mib = sum(self.data["bytes_transferred"]) / 2**20
            seconds = sum(xfer)
            out.update(
                {
                    "Avg xfer time (ms)": round(1e3 * seconds / len(xfer), 3),
                    "P90 xfer time (ms)": round(1e3 * xfer[min(len(xfer) - 1, int(0.9 * len(xfer)))], 3),
                    "Avg post time (ms)": round(1e3 * sum(post) / len(post), 3),
                    "Avg MB per transfer": round(mib / len(xfer), 3),
                    "Throughput (MB/s)": round(mib / seconds, 3) if seconds > 0 else 0,
                    "Avg number of descriptors": round(sum(self.data["num_descriptors"]) / len(xfer), 1),
                }
            )
        out.update(self.counts())
        return out


class EngineFigures:
    """Reads one worker's engine into :class:`KVPushStats`: its finished transfers every call, its
    failure counters (as growth since the previous read) at most every :data:`SAMPLE_EVERY_S`."""

    def __init__(self) -> None:
        self._failures: dict[str, int] = {}
        self._sampled = 0.0

    def collect(self, native: Any, stats: KVPushStats, now: float | None = None) -> None:
        for bytes_, descriptors, post_us, transfer_us in native.take_transfers():
            stats.observe_transfer(bytes_, descriptors, post_us, transfer_us)
        now = time.monotonic() if now is None else now
        if now - self._sampled < SAMPLE_EVERY_S:
            return
        self._sampled = now
        failures = native.stats().get("failures", {})
        for kind in FAILURE_KINDS:
            total = int(failures.get(kind, 0))
            grew = total - self._failures.get(kind, 0)
            self._failures[kind] = total
            if grew > 0:
                stats.record(_failure_key(kind), grew)


# Buckets as vLLM's NIXL connector has them (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py).
TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]
DESCRIPTOR_BUCKETS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]


class KVPushPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvpush_*``: histograms of transfer time, post time, bytes and descriptors per transfer;
    counters of failed transfers, failed notifications, expired leases, failures by ``kind`` and the
    connector's requests (docs/vllm.md)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def per_engine(metric: Any) -> dict[int, Any]:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        def histogram(name: str, doc: str, buckets: list[Any]) -> dict[int, Any]:
            return per_engine(self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames))

        def counter(name: str, doc: str) -> dict[int, Any]:
            return per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))

        self.histograms = {
            "transfer_duration": histogram(
                "vllm:kvpush_xfer_time_seconds", "kvpush: time from post to completion per transfer.", TIME_BUCKETS[1:]
            ),
            "post_duration": histogram(
                "vllm:kvpush_post_time_seconds", "kvpush: time to post one transfer (planning included).", TIME_BUCKETS
            ),
            "bytes_transferred": histogram(
                "vllm:kvpush_bytes_transferred", "kvpush: bytes moved per transfer.", BYTES_BUCKETS
            ),
            "num_descriptors": histogram(
                "vllm:kvpush_num_descriptors", "kvpush: descriptors posted per transfer (after merging).",
                DESCRIPTOR_BUCKETS,
            ),
        }  # fmt: skip
        # Counter name -> the data keys it adds up.
        self.sums = {
            "num_failed_transfers": (_failure_key("post"), _failure_key("transfer"), _failure_key("plan")),
            "num_failed_notifications": (_failure_key("link"),),
            "num_kv_expired_reqs": (_failure_key("lease_expired"),),
        }
        docs = {
            "num_failed_transfers": "kvpush: transfers that failed to plan, post or complete.",
            "num_failed_notifications": "kvpush: control frames (registrations, failures, aborts) not delivered.",
            "num_kv_expired_reqs": "kvpush: requests whose blocks P released when the lease ran out.",
        }
        self.counters = {name: counter(f"vllm:kvpush_{name}", docs[name]) for name in self.sums}
        self.requests = {key: counter(f"vllm:kvpush_{key}", f"kvpush: {key.replace('_', ' ')}") for key in REQUESTS}
        failures = self._counter_cls(
            name="vllm:kvpush_failures",
            documentation="kvpush: the engine's failures by kind (src/engine/stats.rs, Failures).",
            labelnames=[*labelnames, "kind"],
        )
        self.failures = {
            idx: {kind: failures.labels(*values, kind) for kind in FAILURE_KINDS}
            for idx, values in self.per_engine_labelvalues.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for key, metric in self.histograms.items():
            for value in data.get(key) or ():
                metric[engine_idx].observe(value)
        for name, keys in self.sums.items():
            total = sum(int(data.get(k) or 0) for k in keys)
            if total:
                self.counters[name][engine_idx].inc(total)
        for key, metric in self.requests.items():
            if data.get(key):
                metric[engine_idx].inc(data[key])
        for kind, metric in self.failures.get(engine_idx, {}).items():
            if data.get(_failure_key(kind)):
                metric.inc(data[_failure_key(kind)])
