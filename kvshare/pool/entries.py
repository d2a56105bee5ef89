"""The records the index keeps: one entry per chunk, and the leases and reservations that hold entries.

Plain data, mutated only by the index (index.py) on the daemon's loop thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

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
