"""Prometheus metrics: counters the engine bumps, gauges read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# The *_created series double the output and no dashboard here uses them.
disable_created_metrics()


class _StateCollector(Collector):
    """Per-state entry counts and bytes in use, read from the engine when scraped."""

    def __init__(self, counts: Callable[[], dict[str, int]], used: Callable[[], int]) -> None:
        self._counts, self._used = counts, used

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("stager_datasets", "Cache entries by state", labels=["state"])
        for state, count in self._counts().items():
            family.add_metric([state], count)
        yield family
        yield GaugeMetricFamily(
            "stager_cache_used_bytes",
            "Bytes of ready entries plus estimates of stagings under way",
            value=self._used(),
        )


class Metrics:
    def __init__(self) -> None:
        # A registry per app, so tests can build several apps in one process.
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "stager_requests",
            "Stage requests by outcome: miss (new staging), join (already staging), hit (ready), "
            "changed (a ready tree changed since its publish: staged again)",
            ["outcome"],
            registry=self.registry,
        )
        self.failures = Counter(
            "stager_failures",
            "Stagings that ended failed or cancelled, by error type",
            ["type"],
            registry=self.registry,
        )
        self.staged_bytes = Counter(
            "stager_staged_bytes", "Bytes published into the cache", registry=self.registry
        )
        self.evicted_bytes = Counter(
            "stager_evicted_bytes",
            "Bytes removed from the cache by eviction",
            registry=self.registry,
        )
        # Multi-node jobs (docs/multinode.md): what a node read from the shared storage,
        # what it got from other nodes instead, and how each copy arrived.
        self.source_bytes = Counter(
            "stager_source_read_bytes",
            "Bytes stagings read from their sources (the shared storage, URLs), counted "
            "when the staging is published",
            registry=self.registry,
        )
        self.broadcast_bytes = Counter(
            "stager_broadcast_received_bytes",
            "Bytes received from another node of a job (sbcast) and adopted",
            registry=self.registry,
        )
        self.arrivals = Counter(
            "stager_arrivals",
            "How copies arrived on this node: staged (from the source), broadcast (from "
            "another node), hit (a request served from the cache)",
            ["how"],
            registry=self.registry,
        )
        self.evictions = Counter(
            "stager_evictions", "Ready entries removed from the cache", registry=self.registry
        )
        self.waiting = Gauge(
            "stager_waiting_requests",
            "Requests long-polling for a dataset to finish (jobs blocked on this node)",
            registry=self.registry,
        )

    def watch_states(self, counts: Callable[[], dict[str, int]], used: Callable[[], int]) -> None:
        self.registry.register(_StateCollector(counts, used))
