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

    def token_ids(self) -> list[int]:
        return np.frombuffer(self.tokens_le32, dtype="<u4").tolist()


@dataclass(eq=False)
class Lease:
    lease_id: int
    client_id: int
    entries: list[Entry]
    created_at: float
    expires_at: float


@dataclass(eq=False)
class Reservation:
    reservation_id: int
    client_id: int
    entries: list[Entry]
    created_at: float


class IndexListener(Protocol):
    """Told of every visibility change (KV events): pages committed, and committed pages removed."""

    def committed(self, entries: list[Entry]) -> None: ...

    def removed(self, entry: Entry) -> None: ...
