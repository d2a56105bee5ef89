"""The pool daemon's configuration, checked on construction: ``PoolConfig`` (everything ``kvshare pool`` takes)
and its index's part, ``IndexConfig`` (watermarks, TTLs, keys per message, the quota)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvshare.pool import protocol as P
from kvshare.pool.allocator import default_extent_bytes
from kvshare.pool.arena import HUGEPAGES_MODES

if TYPE_CHECKING:  # annotations only: the remote tier's modules import the index, which imports this module
    from kvshare.pool.event_publisher import KVEventsConfig
    from kvshare.pool.remote.config import RemoteConfig


@dataclass(frozen=True)
class IndexConfig:
    high_watermark: float = 0.95  # fraction of the arena in use that starts eviction
    low_watermark: float = 0.90  # ... and where it stops
    lease_ttl_s: float = 300.0
    reservation_ttl_s: float = 600.0  # longer than any copy into a reservation's pages can run
    max_keys: int = 4096  # per message
    namespace_quota_bytes: int = 0  # bytes one account (or namespace) may hold (writing + committed); 0: no quota

    def __post_init__(self) -> None:
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")
        if self.lease_ttl_s <= 0 or self.reservation_ttl_s <= 0 or self.max_keys <= 0:
            raise ValueError("lease_ttl_s, reservation_ttl_s and max_keys must be positive")
        if self.namespace_quota_bytes < 0:
            raise ValueError(f"namespace_quota_bytes must be >= 0, got {self.namespace_quota_bytes}")


@dataclass(frozen=True)
class PoolConfig:
    """Everything ``kvshare pool`` takes; validated on construction."""

    socket_path: str
    size_bytes: int
    extent_bytes: int | None = None  # None: default_extent_bytes(size_bytes)
    hugepages: str = "auto"  # one of arena.HUGEPAGES_MODES: auto takes reserved 2 MiB pages when enough are free
    prefault: bool = False
    socket_mode: int = 0o600  # owner-only unless the operator says otherwise
    allowed_uids: tuple[int, ...] = ()  # empty: only the daemon's own uid
    max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES
    max_unsent_bytes: int = 16 << 20  # a client whose unsent replies pass this is closed (it is not reading them)
    hello_timeout_s: float = 5.0  # a connection that has not said hello by then is closed
    index: IndexConfig = field(default_factory=IndexConfig)
    tick_s: float = 0.25  # lease expiry and stats snapshot period
    # After activity the loop polls without sleeping up to this long before it blocks, while that pays (spin.py):
    # a cross-core wake-up costs ~30 us on these VMs, so a client's next message is seen sooner when it comes soon.
    busy_poll_us: float = 100.0
    remote: RemoteConfig | None = None  # the remote tier (--remote URL); None: this host's arena only
    kv_events: KVEventsConfig | None = None  # publish commits and removals as vLLM KV events (--kv-events)
    direct_lookups: bool = True  # offer the directory to clients that ask (direct.py; x86-64 with membarrier)

    def __post_init__(self) -> None:
        if self.size_bytes <= 0:
            raise ValueError(f"pool size must be positive, got {self.size_bytes}")
        if self.extent_bytes is None:
            object.__setattr__(self, "extent_bytes", default_extent_bytes(self.size_bytes))
        if self.extent_bytes <= 0:
            raise ValueError(f"extent size must be positive, got {self.extent_bytes}")
        if self.hugepages not in HUGEPAGES_MODES:
            raise ValueError(f"hugepages must be one of {', '.join(HUGEPAGES_MODES)}, got {self.hugepages!r}")
        if not self.socket_path:
            raise ValueError("a socket path is required")
        if len(os.fsencode(self.socket_path)) > 107:
            raise ValueError(f"socket path too long for a Unix socket (max 107 bytes): {self.socket_path}")
        if self.remote is not None:
            self.remote.check_lease_ttl(self.index.lease_ttl_s)
            self.remote.check_reservation_ttl(self.index.reservation_ttl_s)
