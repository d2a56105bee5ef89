"""The router's Prometheus metrics: its requests, failovers and timings, and pool_aware's inputs as gauges read at
each scrape (the events' liveness and lag, each replica's measured terms, backlog and credited cache depth)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvshare.serve.metrics import LATENCY_BUCKETS

if TYPE_CHECKING:
    from kvshare.router.calibration import Calibration
    from kvshare.router.kv_event_feed import KVEventFeed
    from kvshare.router.pool_aware import PoolAwarePlacer

SEND_DELAY_BUCKETS = tuple(1e-4 * 2**k for k in range(14))  # seconds: 0.1 ms .. 0.82 s, each twice the last
# (gauge name, help, the Rates field it reads) of each replica's measured terms (kvshare.router.calibration)
RATE_GAUGES = (
    ("prefill_seconds_per_token", "Measured seconds per prompt token a replica computes", "prefill_s_per_token"),
    ("load_seconds_per_token", "Measured seconds per prompt token a replica loads from the pool", "load_s_per_token"),
    (
        "service_seconds",
        "Measured time a request holds a replica (per request in flight of unknown work)",
        "service_s",
    ),
    ("decode_seconds", "Measured time a request holds a replica after its first token", "decode_s"),
    ("overhead_seconds", "Measured time to first token a replica adds to every request", "overhead_s"),
    ("rate_samples", "Responses behind a replica's measured rates (0: the flags' values)", "num_samples"),
    ("prefill_samples", "Responses in a replica's window with computed and pool tokens known", "num_measured"),
)


class RouterMetrics:
    """The router's own counters and histograms, in their own registry (served at /metrics)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvshare_router_requests", "Requests routed", ["replica"], registry=r)
        self.failovers = Counter(
            "kvshare_router_failovers", "Requests moved to another replica before the first byte", registry=r
        )
        self.errors = Counter("kvshare_router_errors", "Requests no replica could take", registry=r)
        self.latency = Histogram(
            "kvshare_router_request_latency_seconds",
            "Time to the end of the response",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.send_delay = Histogram(  # the router's own time in a request's TTFT (its relay of the first byte aside)
            "kvshare_router_send_delay_seconds",
            "From a request's arrival to its sending to a replica: its body read, placed and signed",
            buckets=SEND_DELAY_BUCKETS,
            registry=r,
        )
        self.broken_responses = Counter(
            "kvshare_router_broken_responses",
            "Responses a replica broke off after the first byte (streams end with an error event)",
            ["replica"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvshare_router_replica_healthy", "1 if the replica answered its last health check", ["replica"], registry=r
        )


def hint_counter(registry: CollectorRegistry):
    """The prefetch hints' outcomes (kvshare.router.hint_sender): a function counting one."""
    hints = Counter(
        "kvshare_router_prefetch_hints",
        "Prefetch hints to vLLM replicas by outcome: sent, dropped (no connection, or a replica not reading), refused",
        ["outcome"],
        registry=registry,
    )
    return lambda outcome: hints.labels(outcome).inc()


def register_pool_aware(registry: CollectorRegistry, placer: PoolAwarePlacer) -> None:
    """pool_aware's metrics in ``registry``: its fallbacks (counted as they happen) and its inputs' gauges, each
    replica's labelled by its name in the placer's calibration."""
    fallbacks = Counter(
        "kvshare_router_pool_aware_fallbacks",
        "Requests placed round robin because the pool's KV events were not live",
        registry=registry,
    )
    placer.on_fallback = fallbacks.inc
    _pool_feed_gauges(registry, placer.feed)
    _rate_gauges(registry, placer.calibration)
    names = placer.calibration.names
    queue = Gauge(
        "kvshare_router_pool_aware_queue_seconds",
        "Expected work ahead on a replica: its requests in flight through this router (kvshare.router.backlog)",
        ["replica"],
        registry=registry,
    )
    depth = Gauge(
        "kvshare_router_pool_aware_local_cache_depth_chunks",
        "New chunks sent to a replica since a chunk was used, below which the chunk is credited as held",
        ["replica"],
        registry=registry,
    )
    for i, replica in enumerate(names):
        queue.labels(replica).set_function(lambda i=i: placer.backlog.wait_s(i))
        depth.labels(replica).set_function(lambda i=i: float(placer.sent.credited_depth(i)))
    if placer.replica_feeds:
        own = Gauge(
            "kvshare_router_replica_kv_events_live",
            "1 while a replica's own KV events (--replica-kv-events) are trusted for its GPU prefix cache",
            ["replica"],
            registry=registry,
        )
        for replica, replica_feed in zip(names, placer.replica_feeds):
            own.labels(replica).set_function(lambda f=replica_feed: float(f.why_not_live(time.monotonic()) is None))


def _pool_feed_gauges(registry: CollectorRegistry, feed: KVEventFeed) -> None:
    Gauge("kvshare_router_kv_events_live", "1 while the pool's KV events are trusted", registry=registry).set_function(
        lambda: float(feed.why_not_live(time.monotonic()) is None)
    )
    Gauge(
        "kvshare_router_kv_events_lag_seconds", "Age of the last KV event batch when it arrived", registry=registry
    ).set_function(lambda: feed.lag_s)
    Gauge(
        "kvshare_router_pool_index_chunks", "Chunks the pool holds by its KV events (untenanted)", registry=registry
    ).set_function(lambda: float(len(feed.index)))


def _rate_gauges(registry: CollectorRegistry, calibration: Calibration) -> None:
    for name, help_text, field in RATE_GAUGES:
        gauge = Gauge(f"kvshare_router_pool_aware_{name}", help_text, ["replica"], registry=registry)
        for i, replica in enumerate(calibration.names):
            gauge.labels(replica).set_function(lambda i=i, field=field: float(getattr(calibration.rates(i), field)))
