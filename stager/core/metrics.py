"""Prometheus metrics: counters the engine bumps, gauges read at scrape time.

Named as Prometheus asks (``stager_`` first, the unit last: ``_bytes``,
``_seconds``, ``_total`` for counters), and labelled by what happened (outcome,
state, error type), never by who: no user, job or dataset name is a label, so the
series stay few on a node with thousands of jobs. deploy/grafana/stager-node.json
is the dashboard over them; tests/deploy/test_dashboard.py asks a real Prometheus
every one of its panels' queries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# The *_created series double the output and no dashboard here uses them.
disable_created_metrics()


# Time to ready: from a request's queueing to its data's publish. Seconds for a small
# dataset, hours for ImageNet from a slow filesystem.
READY_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200)


def failure_types() -> list[str]:
    """The ``type`` of every way a staging can end without data (stager.core.errors), and the
    registry's own (an interrupted fan-out feeder, a lost store write)."""
    from stager.core.errors import StagingError

    found, todo = set(), [StagingError]
    while todo:
        cls = todo.pop()
        found.add(cls.type)
        todo.extend(cls.__subclasses__())
    return sorted(found | {"internal_error", "interrupted"})


class _StateCollector(Collector):
    """Per-state entry counts, bytes in use and the cache's room, read when scraped."""

    def __init__(
        self,
        counts: Callable[[], dict[str, int]],
        used: Callable[[], int],
        room: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        self._counts, self._used, self._room = counts, used, room

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
        if self._room is not None:
            capacity, free = self._room()
            yield GaugeMetricFamily(
                "stager_cache_capacity_bytes",
                "What the cache may hold: --capacity-bytes, or the cache disk's size",
                value=capacity,
            )
            yield GaugeMetricFamily(
                "stager_cache_disk_free_bytes", "Free bytes on the cache's disk", value=free
            )


class Metrics:
    def __init__(self) -> None:
        # A registry per app, so tests can build several apps in one process.
        self.registry = CollectorRegistry()
        counter = functools.partial(Counter, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        self.requests = counter(
            "stager_requests",
            "Stage requests by outcome: miss (new staging), join (already staging), hit (ready), "
            "changed (a ready tree changed since its publish: staged again)",
            ["outcome"],
        )
        self.failures = counter(
            "stager_failures", "Stagings that ended failed or cancelled, by error type", ["type"]
        )
        self.staged_bytes = counter("stager_staged_bytes", "Bytes published into the cache")
        self.evicted_bytes = counter(
            "stager_evicted_bytes", "Bytes removed from the cache by eviction"
        )
        self.source_bytes = counter(
            "stager_source_read_bytes",
            "Bytes stagings read from their sources (the shared storage, URLs), counted "
            "when the staging is published",
        )
        self.broadcast_bytes = counter(
            "stager_broadcast_received_bytes",
            "Bytes received from another node of a job (sbcast) and adopted",
        )
        self.arrivals = counter(
            "stager_arrivals",
            "How copies arrived on this node: staged (from the source), broadcast (from "
            "another node), hit (a request served from the cache)",
            ["how"],
        )
        self.evictions = counter("stager_evictions", "Ready entries removed from the cache")
        self.hit_bytes = counter(
            "stager_hit_bytes",
            "Bytes of ready datasets that requests found in the cache (hits): the bytes "
            "that were not staged again",
        )
        self.time_to_ready = histogram(
            "stager_time_to_ready_seconds",
            "Seconds from a staging's request (queued) to its data being ready",
            buckets=READY_BUCKETS,
        )
        self.waiting = gauge(
            "stager_waiting_requests",
            "Requests long-polling for a dataset to finish (jobs blocked on this node)",
        )
        # Pre-staging (stager.prestage.prefetch): started, used by their job, wasted (cancelled,
        # deleted or expired unused), failed (its staging), refused (a bad credential, a
        # budget); the bytes of the first three.
        self.prefetches = counter(
            "stager_prefetches",
            "Prefetches for jobs not started yet, by outcome: "
            "started, used, wasted, failed, refused",
            ["outcome"],
        )
        self.prefetch_bytes = counter(
            "stager_prefetch_bytes",
            "Bytes of prefetches by outcome: started (estimated), used, wasted",
            ["outcome"],
        )
        self.prefetch_hidden_seconds = counter(
            "stager_prefetch_hidden_seconds",
            "Staging seconds hidden in the queue: a prefetch's staging time, when its job's "
            "own request then found the data ready",
        )

        # Every outcome's series exists from the start, at 0, so that its first event is a
        # rise a rate sees (a series born at 1 has no rate until it rises again).
        for outcome in ("miss", "join", "hit", "changed"):
            self.requests.labels(outcome=outcome)
        for how in ("staged", "broadcast", "hit"):
            self.arrivals.labels(how=how)
        for kind in failure_types():
            self.failures.labels(type=kind)
        for outcome in ("started", "used", "wasted", "failed", "refused"):
            self.prefetches.labels(outcome=outcome)
            if outcome not in ("failed", "refused"):
                self.prefetch_bytes.labels(outcome=outcome)

    def watch_states(
        self,
        counts: Callable[[], dict[str, int]],
        used: Callable[[], int],
        room: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        """``room``: (capacity, free) bytes of the cache, asked at each scrape."""
        self.registry.register(_StateCollector(counts, used, room))

    def ready_after(self, seconds: float | None) -> None:
        if seconds is not None:
            self.time_to_ready.observe(seconds)
