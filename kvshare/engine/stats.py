"""EngineStats: the engine's counters, for /metrics and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Cumulative since the engine started (a snapshot when returned by Engine.stats)."""

    num_requests: int = 0
    prompt_tokens_local: int = 0  # prompt tokens whose KV came from the local prefix cache
    prompt_tokens_pool: int = 0  # ... from the shared pool
    prompt_tokens_computed: int = 0  # ... computed by prefill
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    local_hit_chunks: int = 0
    local_miss_chunks: int = 0
    local_inserted_chunks: int = 0
    local_evicted_chunks: int = 0
    local_cache_chunks: int = 0  # held now
    local_cache_bytes: int = 0  # held now
    local_cache_capacity_bytes: int = 0  # the bound now: --local-cache-size, or less once the device ran out
    local_out_of_memory: int = 0  # inserts the device had no room for (each capped the capacity)

    pool_lookups: int = 0
    pool_hit_chunks: int = 0
    pool_miss_chunks: int = 0
    pool_bytes_loaded: int = 0
    pool_load_seconds: float = 0.0
    pool_stored_chunks: int = 0
    pool_bytes_stored: int = 0
    pool_store_seconds: float = 0.0
    pool_skipped_stores: int = 0  # chunks a reserve found no room for (the store is skipped)
    checksum_failures: int = 0  # loaded pages whose bytes did not match their commit checksum
    dropped_chunks: int = 0  # chunks this engine removed from the pool (bad checksums)
    pool_unavailable: int = 0  # times a request went without the pool because it could not be reached
    pool_connects: int = 0  # successful (re)connections
    is_pool_configured: bool = False  # the engine was given a pool socket
    is_pool_connected: bool = False  # ... and is connected to it now (kvshare_pool_connected; read from the link)
    pool_errors: int = 0  # pool calls that failed, the pool down or refusing (logged); the request still completes


# the counters of requests (Engine.uncounted restores them); connection state and failures always count
REQUEST_COUNTERS = (
    "num_requests",
    "prompt_tokens_local",
    "prompt_tokens_pool",
    "prompt_tokens_computed",
    "generated_tokens",
    "prefill_seconds",
    "decode_seconds",
    "pool_lookups",
    "pool_hit_chunks",
    "pool_miss_chunks",
    "pool_bytes_loaded",
    "pool_load_seconds",
    "pool_stored_chunks",
    "pool_bytes_stored",
    "pool_store_seconds",
    "pool_skipped_stores",
    "dropped_chunks",
)
