"""Scratch pages for self-tests: reserved under throwaway keys, never committed, aborted after use.

Works with a ``PoolClient`` and with an in-process ``LocalArena`` (both offer
``reserve`` and ``abort``), so the byte checks run against the real pool and
in unit tests alike without leaving anything visible in the pool.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from kvshare.keys import KEY_BYTES

SCRATCH_NAMESPACE = hashlib.blake2b(b"kvshare-transfer-selftest", digest_size=KEY_BYTES).digest()
MAX_KEYS_PER_RESERVE = 1024


@dataclass
class ScratchPages:
    """Offsets of reserved pages in allocation order (runs stay together), and their reservations."""

    offsets: list[int]
    reservation_ids: list[int]

    def release(self, client) -> None:
        for rid in self.reservation_ids:
            client.abort(rid)
        self.reservation_ids = []


def reserve_scratch(client, page_bytes: int, num_pages: int) -> ScratchPages:
    """Reserve up to ``num_pages`` pages of ``page_bytes``; fewer when the pool has no more room."""
    salt = os.urandom(8)
    scratch = ScratchPages([], [])
    try:
        while len(scratch.offsets) < num_pages:
            count = min(MAX_KEYS_PER_RESERVE, num_pages - len(scratch.offsets))
            base = len(scratch.offsets)
            keys = [
                hashlib.blake2b(salt + (base + i).to_bytes(8, "little"), digest_size=KEY_BYTES).digest()
                for i in range(count)
            ]
            reservation = client.reserve(SCRATCH_NAMESPACE, keys, page_bytes)
            if reservation.reservation_id:
                scratch.reservation_ids.append(reservation.reservation_id)
            scratch.offsets.extend(offset for _, offset in sorted(reservation.grants))
            if len(reservation.grants) < count:
                break  # the pool is full
    except BaseException:
        scratch.release(client)
        raise
    return scratch
