"""A replica's Prometheus metrics: vLLM's names and labels (``model_name``) under the ``kvshare_`` prefix.

Every kvshare endpoint (replica, router ``kvshare_router_``, pool ``kvshare_pool_``) names its metrics
in one scheme that ``promtool check metrics`` accepts: snake_case, no colons, counters ending in
``_total``, base units (seconds, bytes).

The built-in engine runs one request at a time (``kvshare_max_num_running_requests`` is 1); the
others wait in a queue, first come first served. ``kvshare_num_requests_waiting`` is that queue's
depth and ``kvshare_request_queue_time_seconds`` the time a request spent in it, so six concurrent
long prompts show as one running, five waiting, and queue times that grow by one prefill each.
``kvshare up --engine vllm`` batches requests for throughput.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# seconds; up to the slowest request of the study's range (a 256k-token cold prefill took ~47 s on an H200)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)

# engine counter -> (metric name, help); read from engine.stats() at each scrape
ENGINE_COUNTERS = {
    "pool_hit_chunks": ("kvshare_pool_hit_chunks", "Chunks found in the pool"),
    "pool_miss_chunks": ("kvshare_pool_miss_chunks", "Chunks looked up in the pool and not found"),
    "pool_bytes_loaded": ("kvshare_pool_bytes_loaded", "KV bytes loaded from the pool"),
    "pool_bytes_stored": ("kvshare_pool_bytes_stored", "KV bytes stored to the pool"),
    "pool_states_loaded": ("kvshare_pool_checkpoints_loaded", "State checkpoints loaded from the pool (hybrid models)"),
    "pool_state_bytes_loaded": ("kvshare_pool_checkpoint_bytes_loaded", "State checkpoint bytes loaded from the pool"),
    "pool_states_stored": ("kvshare_pool_checkpoints_stored", "State checkpoints stored to the pool (hybrid models)"),
    "pool_state_bytes_stored": ("kvshare_pool_checkpoint_bytes_stored", "State checkpoint bytes stored to the pool"),
    "checksum_failures": ("kvshare_pool_checksum_failures", "Pool pages whose checksum did not match"),
    "skipped_stores": ("kvshare_pool_skipped_stores", "Chunks not stored for lack of pool room"),
    "pool_errors": ("kvshare_pool_errors", "Pool requests that failed (pool down, refused)"),
    "local_hit_chunks": ("kvshare_local_cache_hit_chunks", "Chunks found in the local prefix cache"),
    "local_out_of_memory": (
        "kvshare_local_cache_out_of_memory",
        "Local prefix cache inserts the device had no room for (each capped the cache)",
    ),
}
# engine gauge -> (metric name, help)
ENGINE_GAUGES = {
    "local_cache_bytes": ("kvshare_local_cache_bytes", "KV bytes the local prefix cache holds"),
    "local_cache_capacity_bytes": (
        "kvshare_local_cache_capacity_bytes",
        "The local prefix cache's bound: --local-cache-size, or less once the device ran out",
    ),
}


class _EngineCollector(Collector):
    def __init__(self, read: Callable[[], dict], model_name: str) -> None:
        self._read = read
        self._model_name = model_name

    def collect(self):
        stats = self._read()
        for key, (name, doc) in ENGINE_COUNTERS.items():
            if key in stats:
                yield self._one(CounterMetricFamily(name, doc, labels=["model_name"]), stats[key])
        for key, (name, doc) in ENGINE_GAUGES.items():
            if key in stats:
                yield self._one(GaugeMetricFamily(name, doc, labels=["model_name"]), stats[key])
        if stats.get("is_pool_configured"):  # a replica started with --pool SOCKET
            family = GaugeMetricFamily(
                "kvshare_pool_connected", "1 while the replica is connected to its pool", labels=["model_name"]
            )
            yield self._one(family, int(bool(stats.get("is_pool_connected"))))

    def _one(self, family, value):
        family.add_metric([self._model_name], value)
        return family


class _ByLabel:
    """A metric with ``model_name`` and one more label; ``labels(value)`` fills in the model's name."""

    def __init__(self, metric, model_name: str) -> None:
        self._metric, self._model_name = metric, model_name

    def labels(self, value: str):
        return self._metric.labels(self._model_name, value)


class ReplicaMetrics:
    def __init__(self, read_engine_stats: Callable[[], dict], model_name: str) -> None:
        """``model_name``: the served name, vLLM's ``model_name`` label on every metric."""
        self.registry = CollectorRegistry()
        r, m, model = self.registry, ["model_name"], model_name
        self.requests = _ByLabel(
            Counter("kvshare_request_success", "Finished requests", [*m, "finished_reason"], registry=r), model
        )
        self.errors = _ByLabel(
            Counter("kvshare_request_errors", "Requests answered with an error", [*m, "status"], registry=r), model
        )
        self.ttft = Histogram(
            "kvshare_time_to_first_token_seconds", "Time to first token", m, buckets=LATENCY_BUCKETS, registry=r
        ).labels(model)
        self.e2e = Histogram(
            "kvshare_e2e_request_latency_seconds", "End-to-end request latency", m, buckets=LATENCY_BUCKETS, registry=r
        ).labels(model)
        self.prompt_tokens = Counter("kvshare_prompt_tokens", "Prompt tokens", m, registry=r).labels(model)
        self.prompt_tokens_by_source = _ByLabel(
            Counter(
                "kvshare_prompt_tokens_by_source",
                "Prompt tokens by where their KV came from",
                [*m, "source"],
                registry=r,
            ),
            model,
        )
        self.generation_tokens = Counter("kvshare_generation_tokens", "Generated tokens", m, registry=r).labels(model)
        self.waiting = Gauge(
            "kvshare_num_requests_waiting",
            "Requests queued for the engine (the built-in engine runs one at a time)",
            m,
            registry=r,
        ).labels(model)
        self.running = Gauge("kvshare_num_requests_running", "Requests the engine is running", m, registry=r).labels(
            model
        )
        self.max_running = Gauge(
            "kvshare_max_num_running_requests",
            "Requests the engine runs at once (built-in: 1; --engine vllm batches)",
            m,
            registry=r,
        ).labels(model)
        self.queue_time = Histogram(
            "kvshare_request_queue_time_seconds",
            "Time a request waited for the engine",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self.cancelled = Counter("kvshare_request_cancelled", "Requests whose client went away", m, registry=r).labels(
            model
        )
        self.slow_clients = Counter(
            "kvshare_request_slow_client", "Streams dropped because the client stopped reading", m, registry=r
        ).labels(model)
        r.register(_EngineCollector(read_engine_stats, model))

    def observe_provenance(self, local: int, pool: int, computed: int) -> None:
        self.prompt_tokens.inc(local + pool + computed)
        for source, n in (("local", local), ("pool", pool), ("computed", computed)):
            self.prompt_tokens_by_source.labels(source).inc(n)
