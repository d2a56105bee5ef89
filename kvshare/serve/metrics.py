"""A replica's Prometheus metrics, named in the style of vLLM's (``kvshare:...``).

The built-in engine runs one request at a time (``kvshare:max_num_running_requests`` is 1); the
others wait in a queue, first come first served. ``kvshare:num_requests_waiting`` is that queue's
depth and ``kvshare:request_queue_time_seconds`` the time a request spent in it, so six concurrent
long prompts show as one running, five waiting, and queue times that grow by one prefill each.
``kvshare up --engine vllm`` batches requests for throughput.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)

# engine counter -> (metric name, help); read from engine.stats() at each scrape
ENGINE_COUNTERS = {
    "pool_hit_chunks": ("kvshare:pool_hit_chunks", "Chunks found in the pool"),
    "pool_miss_chunks": ("kvshare:pool_miss_chunks", "Chunks looked up in the pool and not found"),
    "pool_bytes_loaded": ("kvshare:pool_bytes_loaded", "KV bytes loaded from the pool"),
    "pool_bytes_stored": ("kvshare:pool_bytes_stored", "KV bytes stored to the pool"),
    "checksum_failures": ("kvshare:pool_checksum_failures", "Pool pages whose checksum did not match"),
    "skipped_stores": ("kvshare:pool_skipped_stores", "Chunks not stored for lack of pool room"),
    "pool_errors": ("kvshare:pool_errors", "Pool requests that failed (pool down, refused)"),
    "local_hit_chunks": ("kvshare:local_cache_hit_chunks", "Chunks found in the local prefix cache"),
    "local_out_of_memory": ("kvshare:local_cache_out_of_memory",
                            "Local prefix cache inserts the device had no room for (each capped the cache)"),
}
# engine gauge -> (metric name, help)
ENGINE_GAUGES = {
    "local_cache_bytes": ("kvshare:local_cache_bytes", "KV bytes the local prefix cache holds"),
    "local_cache_capacity_bytes": ("kvshare:local_cache_capacity_bytes",
                                   "The local prefix cache's bound: --local-cache-size, or less once the device ran out"),
}


class _EngineCollector(Collector):
    def __init__(self, read: Callable[[], dict]) -> None:
        self._read = read

    def collect(self):
        stats = self._read()
        for key, (name, doc) in ENGINE_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(name, doc, value=stats[key])
        for key, (name, doc) in ENGINE_GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=stats[key])
        if stats.get("is_pool_configured"):  # a replica started with --pool SOCKET
            yield GaugeMetricFamily("kvshare:pool_connected", "1 while the replica is connected to its pool",
                                    value=int(bool(stats.get("is_pool_connected"))))


class ReplicaMetrics:
    def __init__(self, read_engine_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvshare:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.errors = Counter("kvshare:request_errors", "Requests answered with an error", ["status"], registry=r)
        self.ttft = Histogram("kvshare:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvshare:e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvshare:prompt_tokens", "Prompt tokens", registry=r)
        self.prompt_tokens_by_source = Counter(
            "kvshare:prompt_tokens_by_source", "Prompt tokens by where their KV came from", ["source"], registry=r
        )
        self.generation_tokens = Counter("kvshare:generation_tokens", "Generated tokens", registry=r)
        self.waiting = Gauge("kvshare:num_requests_waiting",
                             "Requests queued for the engine (the built-in engine runs one at a time)", registry=r)
        self.running = Gauge("kvshare:num_requests_running", "Requests the engine is running", registry=r)
        self.max_running = Gauge("kvshare:max_num_running_requests",
                                 "Requests the engine runs at once (built-in: 1; --engine vllm batches)", registry=r)
        self.queue_time = Histogram("kvshare:request_queue_time_seconds", "Time a request waited for the engine",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.cancelled = Counter("kvshare:request_cancelled", "Requests whose client went away", registry=r)
        self.slow_clients = Counter("kvshare:request_slow_client", "Streams dropped because the client stopped reading",
                                    registry=r)
        r.register(_EngineCollector(read_engine_stats))

    def observe_provenance(self, local: int, pool: int, computed: int) -> None:
        self.prompt_tokens.inc(local + pool + computed)
        for source, n in (("local", local), ("pool", pool), ("computed", computed)):
            self.prompt_tokens_by_source.labels(source).inc(n)
