"""The worker side's calls to the pool: which connection a lease belongs to, drops, reserve / commit / abort.

A pool that is gone or stuck never raises out of here: the call is counted (``pool_errors``), the
link marked down, and the caller told "none" (no client, no reservation, nothing committed).
"""

from __future__ import annotations

import logging
from typing import Protocol

from kvshare.integrations.vllm.counters import ConnectorCounters, PhaseTimes
from kvshare.integrations.vllm.metadata import StoreSpec
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.client import PoolRequestError
from kvshare.pool.link import POOL_DOWN_ERRORS, PoolLink, guarded

log = logging.getLogger("kvshare.integrations")


def release_lease(link: PoolLink, lease_id: int, pool_id: bytes) -> None:
    """Release a lease ``link`` took (its holder, reconnected or not) while the pool that granted it still runs;
    where the pool is unreachable now, once the link is back to it."""
    client = link.client()
    if client is None:
        link.end_later(lease_id=lease_id, pool_id=pool_id)
        return
    if link.pool_id != pool_id:  # granted by a pool that is gone, with its holds
        return
    client.release([lease_id])  # fire and forget; a broken socket closes the client


class StorePool(Protocol):
    """What the GPU stores need to reserve, commit and abort pages (PoolPages is one)."""

    kv_layout: KVLayout

    def reserve(self, client, spec: StoreSpec, times: PhaseTimes): ...

    def client_for(self, pool_id: bytes): ...

    def commit(
        self, client, spec: StoreSpec, reservation, checksums: list[int], kind: ChecksumKind, times: PhaseTimes
    ) -> int: ...

    def abort(self, client, reservation_id: int, exc: BaseException | None) -> None: ...


class PoolPages:
    """One worker's pool calls, through its link, counted in its counters."""

    def __init__(self, link: PoolLink, kv_layout: KVLayout, counters: ConnectorCounters) -> None:
        self.link = link
        self.kv_layout = kv_layout
        self.counters = counters

    def client_for(self, pool_id: bytes):
        """The client mapped onto the arena of the pool ``pool_id`` (reconnecting once), or (None, why)."""
        client = self.link.client()
        if client is not None and self.link.pool_id != pool_id:
            client = self.link.reconnect_now()  # the pool was restarted since our last call
        if client is None:
            return None, "the pool is unreachable"
        if self.link.pool_id != pool_id:
            return None, (
                f"lease lost: it came from pool {pool_id.hex()[:8]}, the pool now is "
                f"{self.link.pool_id.hex()[:8]} (restarted)"
            )
        return client, ""

    def drop(self, key: bytes) -> None:
        """Remove a chunk found bad from the pool so nobody else loads it."""
        client = self.link.client()
        if client is None:
            return
        guarded(self.link, self.counters, "to drop a bad chunk", lambda: client.drop([key]))

    def reserve(self, client, spec: StoreSpec, times: PhaseTimes):
        """Pages for the spec's chunks the pool does not hold yet, or None (none granted, or a pool error)."""
        if not spec.keys:
            return None
        reservation = guarded(
            self.link,
            self.counters,
            "a reserve",
            lambda: spec.reserve(client, self.kv_layout.page_bytes),
        )
        if reservation is None:
            return None
        self.counters.skipped_stores += reservation.num_no_room
        times.mark("reserve")
        return reservation if reservation.grants else None

    def commit(
        self, client, spec: StoreSpec, reservation, checksums: list[int], kind: ChecksumKind, times: PhaseTimes
    ) -> int:
        """Make the filled pages visible with their checksums; returns pages committed (0 after a failure)."""
        try:
            committed = client.commit(reservation.reservation_id, checksums, kind)
        except (PoolRequestError, *POOL_DOWN_ERRORS) as exc:
            self.abort(client, reservation.reservation_id, exc)
            return 0
        times.mark("commit")
        self.counters.stored_chunks += committed
        self.counters.store_bytes += committed * self.kv_layout.page_bytes
        self.counters.store_seconds += times.total
        log.debug("kvshare timing: store %s chunks=%d %s", spec.req_id, committed, times.line())
        return committed

    def abort(self, client, reservation_id: int, exc: BaseException | None) -> None:
        """Give reserved pages back: after a failure ``exc`` (counted, logged), or quietly (None: the step's
        KV may not be stored, e.g. it was computed from a load that failed)."""
        if exc is not None:
            self.counters.pool_errors += 1
            log.warning("kvshare: store failed (%s: %s); its pages are aborted", type(exc).__name__, exc)
            if isinstance(exc, POOL_DOWN_ERRORS):
                self.link.failed(exc)
                self.link.end_later(reservation_id=reservation_id, pool_id=client.hello.pool_id)
                return
        try:
            client.abort(reservation_id)
        except POOL_DOWN_ERRORS as abort_exc:
            self.link.failed(abort_exc)
            self.link.end_later(reservation_id=reservation_id, pool_id=client.hello.pool_id)
        except PoolRequestError:
            pass
