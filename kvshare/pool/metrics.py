"""The pool's stats in Prometheus text format (``kvshare pool --metrics-port``)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_GAUGES = {
    "capacity_bytes": "Arena size in bytes",
    "used_bytes": "Bytes of the arena in allocated pages",
    "entries": "Committed chunks in the index",
    "checkpoints": "Committed state checkpoints (hybrid models) among the entries",
    "checkpoint_bytes": "Bytes of the committed state checkpoints",
    "writing": "Reserved chunks not yet committed",
    "leases": "Read leases held",
    "reservations": "Open reservations",
    "clients": "Connected clients",
    "namespaces": "Namespaces (model + tenant) that hold pages",
}
_COUNTERS = {
    "lookups": "Lookup requests",
    "hit_chunks": "Chunks found by lookups",
    "miss_chunks": "Chunks asked for and not found",
    "committed_pages": "Pages committed",
    "aborted_pages": "Pages aborted (including by disconnects)",
    "skipped_stores": "Pages a reserve could not grant for lack of room",
    "evictions": "Pages evicted",
    "evicted_bytes": "Bytes evicted",
    "dropped_pages": "Pages dropped (bad chunks, flushes)",
    "expired_leases": "Leases released by their TTL",
    "expired_reservations": "Reservations aborted by their TTL",
    "orphaned_holders": "Connections closed while their process lived (their leases and reservations kept)",
    "ended_holders": "Orphaned holders whose process exited (their leases and reservations ended)",
    "requests": "Control messages handled",
    "errors": "Error replies",
    "protocol_errors": "Malformed or oversized frames and version mismatches",
    "connections": "Client connections accepted",
    "refused_peers": "Connections refused by the uid check",
    "quota_evictions": "Pages a namespace over its quota evicted of its own",
    "quota_skipped_pages": "Pages not granted because their namespace was at its quota",
    "state_lookups": "Lookups that named state checkpoints (hybrid models)",
    "state_hits": "Lookups that found a state checkpoint",
}


class PoolCollector(Collector):
    """Reads a stats dict (the daemon's latest snapshot) at each scrape."""

    def __init__(self, read_stats: Callable[[], dict], prefix: str = "kvshare_pool_") -> None:
        self._read_stats = read_stats
        self._prefix = prefix

    def collect(self):
        stats = self._read_stats()
        for name, doc in _GAUGES.items():
            if name in stats:
                yield GaugeMetricFamily(self._prefix + name, doc, value=stats[name])
        for name, doc in _COUNTERS.items():
            if name in stats:
                yield CounterMetricFamily(self._prefix + name, doc, value=stats[name])
        for group, doc in (("pages_used", "Pages in use by page size"), ("pages_free", "Free pages by page size")):
            family = GaugeMetricFamily(self._prefix + group, doc, labels=["page_bytes"])
            for size, count in stats.get(group, {}).items():
                family.add_metric([size], count)
            yield family
        for name, value in stats.get("remote", {}).items():
            if isinstance(value, (int, float)):
                yield GaugeMetricFamily(self._prefix + "remote_" + name, f"Remote tier: {name}", value=value)
        for name, value in stats.get("kv_events", {}).items():
            yield CounterMetricFamily(self._prefix + "kv_events_" + name, f"KV events: {name}", value=value)


def serve_metrics(read_stats: Callable[[], dict], port: int, host: str = "127.0.0.1") -> None:
    """Serve /metrics on a background thread."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(PoolCollector(read_stats))
    start_http_server(port, addr=host, registry=registry)
