"""The pool's remote tier: pools on several hosts share pages through a Redis/Valkey store.

The daemon sees only what this package exports: ``RemoteConfig`` (its settings),
``RemoteHooks`` (what the daemon calls) and ``start_remote_tier``. Modules, lowest
first (each imports only those above it)::

    config      RemoteConfig (one field per --remote-* flag), URL parsing; pure
    format      keys and part values of a page in the store; pure
    breaker     the circuit breaker in front of the store
    resp        a minimal RESP connection: bulk replies received straight into the caller's buffer
    reader      StoreReader: pipelined GETs over pooled connections, spread over cluster nodes
    store       RemoteStore: reads through reader, the rest through redis-py (the only module that imports it)
    counters    RemoteCounters (stats["remote"]) and how a fetch's outcome counts
    cost        what recomputing and fetching cost: how much of a lookup to promote; pure fits
    workers     the threads' side: write pages behind, fetch pages as values, copy into the arena
    direct      the threads' side of the fast path: fetch pages straight into reserved arena pages
    jobs        a promoting lookup's state and its batches; plain data
    promotion   the loop's side of a lookup that goes on to the store
    tier        RemoteTier: the loop's side of the whole tier
    hooks       RemoteHooks, the daemon's interface to the tier, and start_remote_tier

docs/remote.md describes the flows.
"""

from kvshare.pool.remote.config import RemoteConfig
from kvshare.pool.remote.hooks import RemoteHooks, start_remote_tier

__all__ = ["RemoteConfig", "RemoteHooks", "start_remote_tier"]
