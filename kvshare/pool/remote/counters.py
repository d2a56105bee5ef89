"""The remote tier's counters, exported as ``stats["remote"]``; one writer each: the daemon's loop thread.

Shared by the tier (write-behind) and its promotions, so it sits below both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from kvshare.pool.remote.format import REASONS

log = logging.getLogger("kvshare.pool.remote")


class FetchOutcome(Protocol):
    """What every fetch reports (workers.FetchResult, direct.LandedResult)."""

    num_errors: int
    num_deleted: int
    discarded: list[tuple[str, str]]  # (reason, what was wrong)


@dataclass
class RemoteCounters:
    lookups: int = 0  # lookups that went on to the store
    joined_lookups: int = 0  # lookups that waited for a promotion already under way
    hit_chunks: int = 0  # chunks the store supplied, whole and valid
    miss_chunks: int = 0  # chunks asked of the store and not supplied
    promoted_pages: int = 0
    promoted_bytes: int = 0
    promote_timeouts: int = 0  # lookups answered at --remote-promote-timeout with what had arrived
    promote_busy: int = 0  # lookups not sent on: --remote-max-promotions under way
    promote_no_room: int = 0  # fetched pages the arena had no room for
    cost_checked_lookups: int = 0  # lookups whose promotion the replicas' prefill rate and the store's decided
    skipped_slower_lookups: int = 0  # answered at once, as a miss: the store would be slower than recomputing
    skipped_slower_chunks: int = 0  # chunks not asked for, as slower than recomputing (whole lookups or tails)
    remeasures: int = 0  # background fetches that timed the store again while lookups were skipped
    written_pages: int = 0
    written_bytes: int = 0
    write_existing: int = 0  # pages the store held already (expiry refreshed)
    write_dropped_full: int = 0  # not written: the write-behind queue was full
    write_dropped_breaker: int = 0
    write_failed: int = 0
    write_expired: int = 0
    write_bad_pages: int = 0
    errors: int = 0  # failed store operations (timeouts, refused connections, ...)
    deleted_values: int = 0  # broken values removed from the store
    discarded_checksum: int = 0
    discarded_version: int = 0
    discarded_fingerprint: int = 0
    discarded_truncated: int = 0
    discarded_missing_part: int = 0
    discarded_unauthenticated: int = 0  # pages without a valid tag for the page key (a store that lies)

    def count_fetch(self, result: FetchOutcome, is_in_chain: bool = True) -> None:
        """Errors and deletions always; discards only of batches still in the chain (not fetched past its end)."""
        self.errors += result.num_errors
        self.deleted_values += result.num_deleted
        for reason, detail in result.discarded if is_in_chain else ():
            name = f"discarded_{reason}"
            setattr(self, name, getattr(self, name) + 1)
            log.warning("discarded a remote page (%s): %s", reason, detail)


# every reason a remote page is discarded for has its counter
assert set(REASONS) == {
    n.removeprefix("discarded_") for n in RemoteCounters.__dataclass_fields__ if n.startswith("discarded_")
}
