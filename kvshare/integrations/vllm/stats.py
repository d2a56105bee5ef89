"""The connector's counters in vLLM's own metrics: KVConnectorStats and Prometheus counters.

Both connector sides return a ``KVShareStats`` per step (the counts since their last
report); vLLM aggregates them, hands the sum to its logger process, and there
``KVSharePromMetrics.observe`` adds it to counters served on vLLM's ``/metrics`` as
``vllm:kvshare_<counter>_total`` (e.g. ``vllm:kvshare_loaded_tokens_total``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvshare.integrations.vllm.counters import COUNTER_NAMES, ConnectorCounters

_HELP = {
    "lookups": "Pool lookups made by the kvshare connector",
    "hit_tokens": "Prompt tokens vLLM was told the kvshare pool supplies",
    "loaded_tokens": "Prompt tokens copied from the kvshare pool into vLLM's KV cache and verified",
    "async_loads": "kvshare loads run beside vLLM's steps while their request waited (others kept decoding)",
    "load_bytes": "KV bytes copied from the kvshare pool",
    "load_seconds": "Seconds spent copying KV from the kvshare pool",
    "stored_chunks": "Chunks (pages) committed to the kvshare pool",
    "stored_states": "GDN state checkpoints of a hybrid model committed to the kvshare pool",
    "loaded_states": "GDN state checkpoints of a hybrid model loaded from the kvshare pool with all of their KV",
    "store_bytes": "KV bytes copied into the kvshare pool",
    "store_seconds": "Seconds spent copying KV into the kvshare pool",
    "skipped_stores": "Chunks not stored because the kvshare pool had no room",
    "verified_pages": "kvshare pool pages whose checksum was checked before use (all, or a sampled share)",
    "checksum_failures": "kvshare pool pages whose checksum did not match (recomputed)",
    "load_failures": "kvshare loads that stopped early; vLLM recomputed the rest",
    "pool_errors": "Failed calls to the kvshare pool daemon",
    "expired_leases": "kvshare leases released because vLLM never scheduled their request",
    "hints": "Prefetch hints from the kvshare router received with a valid tag",
    "hints_refused": "Frames on the kvshare hint address refused (tag, age, size or form)",
    "prefetched_pages": "kvshare pool pages copied ahead of their load on a router hint",
    "prefetch_hits": "kvshare pool pages a load took from a copy ahead instead of the pool",
    "prefetches_unused": "kvshare copies ahead dropped after their bound without a load taking them",
}


@dataclass
class KVShareStats(KVConnectorStats):
    """Counts since the last report; ``data`` is a flat {counter: number} dict (serialisable)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = ConnectorCounters().to_dict()

    @classmethod
    def of(cls, counters: ConnectorCounters) -> KVShareStats:
        return cls(data=counters.to_dict())

    def aggregate(self, other: KVConnectorStats) -> KVShareStats:
        total = ConnectorCounters()
        total.add(self.data)
        total.add(other.data)
        return KVShareStats(data=total.to_dict())

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in COUNTER_NAMES}

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTER_NAMES)


class KVSharePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per ConnectorCounters field, labelled like vLLM's own metrics."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in COUNTER_NAMES:
            counter = self._counter_cls(name=f"vllm:kvshare_{name}", documentation=_HELP[name], labelnames=labelnames)
            self._counters[name] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
