"""The records the index keeps: one entry per chunk, and the leases and reservations that hold entries.

Plain data, mutated only by the index (index.py) on the daemon's loop thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvshare.pool.checksum import ChecksumKind


class EntryState(enum.Enum):
    WRITING = "writing"
    COMMITTED = "committed"


@dataclass(eq=False)
class Entry:
    key: bytes
    namespace: bytes
    offset: int
    page_bytes: int
    depth: int  # position of this chunk in its chain
    state: EntryState
    reservation_id: int  # the reservation that wrote it
    num_leases: int = 0
    checksum: int = 0
    checksum_kind: ChecksumKind = ChecksumKind.XXH3
    is_dropped: bool = False  # removed from view; page freed when the last lease goes
    parent_key: bytes | None = None  # the chunk before this one in its chain, when the writer named it
    tokens_le32: bytes = b""  # the chunk's token ids (little-endian u32) when the writer sent them: KV events
    account: bytes = b""  # whose quota holds the page, when the writer named one (quota.py)
    # what a lookup reply says of the page (a protocol PageHeader), made by the first lookup: a committed entry's
    # offset, size and checksum never change, so every later lookup sends the same one
    header: object = None
    gen: int = 0  # this entry's generation in the directory (direct.py); 0: not published there
    is_state: bool = False  # a state checkpoint (protocol.Reserve.holds_states), not a chunk's KV

    @property
    def quota_owner(self) -> bytes:
        """What the quota charges for this page: the writer's account, else the namespace."""
        return self.account or self.namespace

    def token_ids(self) -> list[int]:
        return np.frombuffer(self.tokens_le32, dtype="<u4").tolist()


@dataclass(eq=False)
class Lease:
    """The pool's record of a lease: which client holds which entries, until when (a client sees a LeaseGrant)."""

    lease_id: int
    client_id: int
    entries: list[Entry]
    created_at: float
    expires_at: float


@dataclass(eq=False)
class Reservation:
    """The pool's record of a reservation: which client writes which entries (a client sees a ReservationGrant)."""

    reservation_id: int
    client_id: int
    entries: list[Entry]
    created_at: float


class IndexListener(Protocol):
    """Told of every visibility change (KV events): pages committed, and committed pages removed."""

    def committed(self, entries: list[Entry]) -> None: ...

    def removed(self, entry: Entry) -> None: ...


@dataclass
class IndexCounters:
    lookups: int = 0
    hit_chunks: int = 0
    miss_chunks: int = 0
    reserved_pages: int = 0
    committed_pages: int = 0
    aborted_pages: int = 0
    skipped_stores: int = 0  # pages a reserve could not grant for lack of room
    evictions: int = 0
    evicted_bytes: int = 0
    dropped_pages: int = 0
    expired_leases: int = 0
    expired_reservations: int = 0  # aborted by their TTL: a writer that never finished
    quota_evictions: int = 0  # pages a namespace over its quota evicted of its own
    quota_skipped_pages: int = 0  # pages a reserve did not grant because the namespace was at its quota
    state_lookups: int = 0  # lookups that named state checkpoints (a hybrid model's)
    state_hits: int = 0  # ... and found one


@dataclass(frozen=True)
class LookupResult:
    lease_id: int  # 0 when nothing was leased
    entries: list[Entry]
    state: tuple[int, Entry] | None = None  # a lookup with state candidates: (the candidate's index, its entry)


@dataclass(frozen=True)
class ReserveResult:
    reservation_id: int  # 0 when nothing was granted
    grants: list[tuple[int, Entry]]  # (index into the request's keys, entry to write)
    num_no_room: int
