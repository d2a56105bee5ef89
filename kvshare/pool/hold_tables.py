"""The hold tables of direct lookups (direct.py), as the pool reads them: memory its clients write, read as if every
client were hostile.

A holder that asks for direct lookups gets a table of its own, a memfd it maps writable::

    words [0, HEADER_WORDS)            header: HWM (holds in use lie below it), the client's counters (LOOKUPS,
                                       HIT_CHUNKS, TOUCHES written, MISS_CHUNKS), CLOSED (written by the pool)
    words [HEADER_WORDS, +TOUCH_RING)  a ring of the generations the client read, for the LRU order
    then num_holds holds               (generation, lease id): "this holder may be reading that page"

The pool trusts nothing there beyond that one sentence, and reads it so that no content can crash it, stall it
beyond a bound, keep a page past a lease's TTL or make it free a page another holder holds:

- it copies before it scans: a scan reads the high-water mark once, copies the holds below it (never more than the
  table holds), and looks only at the copy; a word the client changes meanwhile is in the copy or not;
- it bounds what it scans: a uid has at most MAX_TABLES_PER_UID tables (a client past that takes the round trip),
  a table num_holds holds and TOUCH_RING touches; a counter counts at most COUNTER_MAX;
- it times a hold by its own clock from its first sight of the hold (slot, generation, lease id): one it has
  seen for ``ttl_s`` no longer counts. The lease id is part of the hold because a client that leases one page
  again and again (a hot prefix) stores the same generation in the same slot between two scans: without it, the
  pool would take each new lease for the first and end it early;
- a page out of view is kept only for the holds its first scan after the barrier saw (``holds_naming``), each
  until it changes (a client that rewrites the lease id ends its own hold) or its TTL passes: only those can
  belong to a reader the directory did not turn away, so a hold written later, a generation guessed, a hold
  moved or relabelled keeps nothing. So no table content keeps a page past a lease's TTL after it left view; a
  page in view it can only keep from eviction, as a client leasing it again and again over the socket could;
- it closes a table to new holds before it forgets a live holder (``seal``): the CLOSED word, the barrier, a last
  scan. A reader that stores a hold after the barrier sees CLOSED when it checks and leases nothing.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvshare.pool.arena import SIZE_SEALS

HEADER_WORDS = 8
HWM, LOOKUPS, HIT_CHUNKS, TOUCHES, MISS_CHUNKS, CLOSED = range(6)
TOUCH_RING = 1024
HOLD_WORDS = 2
HOLD_GEN, HOLD_LEASE = range(HOLD_WORDS)
HOLDS_AT_WORD = HEADER_WORDS + TOUCH_RING
DEFAULT_HOLDS = 4096  # holds one holder may have at once (pages leased); more take the round trip
# Tables one uid may have at once: each costs the pool two fds and its share of every scan (a full table of garbage:
# 0.2 ms of CPU to copy and scan, 0.5 ms with the stats' lease count, on the 2-core development host). A process's
# pool links need one or two; a client past the cap takes the round trip.
MAX_TABLES_PER_UID = 32
COUNTER_MAX = 1 << 48  # a table's counter counts at most this much: the stats' sums stay encodable (< 2**64)
_COUNTERS = {"lookups": LOOKUPS, "hit_chunks": HIT_CHUNKS, "miss_chunks": MISS_CHUNKS}


def hold_table_bytes(num_holds: int) -> int:
    return (HOLDS_AT_WORD + num_holds * HOLD_WORDS) * 8


def saturated(count: int) -> int:
    """A count read from a client, or a sum of them, as the pool reports it: between 0 and COUNTER_MAX."""
    return min(max(count, 0), COUNTER_MAX)


@dataclass(frozen=True)
class HoldRef:
    """A hold one scan saw: in which table and slot, naming which generation under which lease id, first seen by
    the pool when."""

    table: HoldTable
    slot: int
    gen: int
    lease: int
    first_seen: float


@dataclass(frozen=True)
class Scan:
    """The live holds of one table at one moment, from a copy: slot, generation, lease id, first seen (arrays)."""

    table: HoldTable
    slots: np.ndarray
    gens: np.ndarray
    leases: np.ndarray
    first_seen: np.ndarray


class HoldTable:
    """One holder's table: the memfd the client writes, and what the pool has seen of it."""

    def __init__(self, holder_id: int, uid: int, num_holds: int) -> None:
        self.holder_id, self.uid, self.num_holds = holder_id, uid, num_holds
        self.fd = os.memfd_create("kvshare-holds", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, hold_table_bytes(num_holds))
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
            self.mapping = mmap.mmap(self.fd, hold_table_bytes(num_holds), mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self._words = np.frombuffer(self.mapping, dtype="<u8")
        self._holds = self._words[HOLDS_AT_WORD:].reshape(num_holds, HOLD_WORDS)
        # per slot: the hold (generation, lease id) the pool saw there last, and since when (the pool's clock)
        self._seen = np.zeros((num_holds, HOLD_WORDS), dtype=np.uint64)
        self._seen_at = np.zeros(num_holds, dtype=np.float64)
        self.touches_read = 0
        self.is_open = True

    def word(self, index: int) -> int:
        """One header word, read once."""
        return int(self._words[index])

    def scan(self, now: float, ttl_s: float) -> Scan:
        """The table's live holds: set, below the high-water mark, and first seen less than ``ttl_s`` ago."""
        num = min(self.word(HWM), self.num_holds)
        holds = np.array(self._holds[:num])  # the one read of the client's words: everything below uses the copy
        seen, seen_at = self._seen[:num], self._seen_at[:num]
        is_new = (holds != seen).any(axis=1)
        seen[is_new] = holds[is_new]
        seen_at[is_new] = now
        self._seen[num:] = 0  # above the mark nothing is held: a hold written there later is new
        gens = holds[:, HOLD_GEN]
        slots = np.flatnonzero((gens != 0) & (seen_at > now - ttl_s))
        return Scan(self, slots, gens[slots], holds[slots, HOLD_LEASE], seen_at[slots])

    def still_holds(self, ref: HoldRef, now: float, ttl_s: float) -> bool:
        """Whether a hold seen before is still there unchanged, within its TTL, in a table still read."""
        if not self.is_open or now - ref.first_seen >= ttl_s:
            return False
        return int(self._holds[ref.slot, HOLD_GEN]) == ref.gen and int(self._holds[ref.slot, HOLD_LEASE]) == ref.lease

    def touched_gens(self) -> list[int]:
        """Generations the client read since the last call, oldest first (at most the ring's length)."""
        written = self.word(TOUCHES)
        start = max(self.touches_read, written - TOUCH_RING)
        self.touches_read = written
        if start >= written:
            return []
        ring = np.array(self._words[HEADER_WORDS:HOLDS_AT_WORD])
        return ring[np.arange(start, written, dtype=np.uint64) % TOUCH_RING].tolist()

    def set_closed(self, is_closed: bool) -> None:
        self._words[CLOSED] = int(is_closed)

    def close(self) -> None:
        self.is_open = False
        os.close(self.fd)
        del self._holds, self._words
        self.mapping.close()


class HoldTables:
    """Every holder's table, by holder id; ``barrier`` runs membarrier(GLOBAL_EXPEDITED) (direct.py)."""

    def __init__(self, num_holds: int, ttl_s: float, barrier: Callable[[], None]) -> None:
        self.num_holds = num_holds
        self.ttl_s = ttl_s
        self._barrier = barrier
        self._tables: dict[int, HoldTable] = {}
        self.closed_counters = dict.fromkeys(_COUNTERS, 0)  # of the tables already closed

    def table_fd(self, holder_id: int, uid: int) -> int | None:
        """The memfd of the holder's table, open to new holds (made at its first hello; the same one after a
        reconnect); None when its uid has MAX_TABLES_PER_UID tables already."""
        table = self._tables.get(holder_id)
        if table is None:
            if sum(t.uid == uid for t in self._tables.values()) >= MAX_TABLES_PER_UID:
                return None
            table = self._tables[holder_id] = HoldTable(holder_id, uid, self.num_holds)
        table.set_closed(False)  # a connection speaks for the holder again: its lookups may hold
        return table.fd

    def __len__(self) -> int:
        return len(self._tables)

    def seal(self, holder_id: int, now: float) -> int:
        """Close the holder's table to new holds and return its live holds (0: it may be forgotten). A reader that
        stored a hold before the barrier is in the scan; one that stores after it sees CLOSED and leases nothing."""
        table = self._tables.get(holder_id)
        if table is None:
            return 0
        table.set_closed(True)
        self._barrier()
        return len(table.scan(now, self.ttl_s).slots)

    def keep_tables_of(self, holder_ids: Iterable[int]) -> None:
        """Close the tables of holders no longer known (their holds have ended: holders.py says when)."""
        kept = set(holder_ids)
        for holder_id in [h for h in self._tables if h not in kept]:
            table = self._tables.pop(holder_id)
            for name, word in _COUNTERS.items():
                self.closed_counters[name] = saturated(self.closed_counters[name] + saturated(table.word(word)))
            table.close()

    def scans(self, now: float, holder_id: int | None = None) -> list[Scan]:
        """A scan of every table (or the holder's)."""
        return [t.scan(now, self.ttl_s) for h, t in self._tables.items() if holder_id in (None, h)]

    def held_gens(self, now: float) -> set[int]:
        """Generations named by a live hold in any table (no barrier: what was held a moment ago)."""
        return {gen for scan in self.scans(now) for gen in scan.gens.tolist()}

    def holds_naming(self, gens: set[int], now: float) -> dict[int, list[HoldRef]]:
        """After a barrier: the live holds that name each of ``gens`` (pages that just left view)."""
        self._barrier()
        refs: dict[int, list[HoldRef]] = {}
        wanted = np.fromiter(gens, dtype=np.uint64, count=len(gens))
        for scan in self.scans(now):
            for i in np.flatnonzero(np.isin(scan.gens, wanted)).tolist():
                gen = int(scan.gens[i])
                ref = HoldRef(scan.table, int(scan.slots[i]), gen, int(scan.leases[i]), float(scan.first_seen[i]))
                refs.setdefault(gen, []).append(ref)
        return refs

    def is_held(self, ref: HoldRef, now: float) -> bool:
        return ref.table.still_holds(ref, now, self.ttl_s)

    def live_holds_and_leases(self, now: float) -> tuple[int, int]:
        """Live holds (pages) and leases (distinct lease ids with a live hold) over every table."""
        scans = self.scans(now)
        return sum(len(scan.slots) for scan in scans), sum(len(np.unique(scan.leases)) for scan in scans)

    def lease_rows(self, now: float) -> list[tuple[int, int, int, float]]:
        """(lease id, holder id, pages, seconds since the pool first saw it) of every live direct lease."""
        rows = []
        for scan in self.scans(now):
            if not len(scan.slots):
                continue
            order = np.argsort(scan.leases, kind="stable")  # a table's holds grouped by lease id
            leases, starts, counts = np.unique(scan.leases[order], return_index=True, return_counts=True)
            firsts = np.minimum.reduceat(scan.first_seen[order], starts)
            holder = scan.table.holder_id
            rows += [
                (lease, holder, n, now - first)
                for lease, n, first in zip(leases.tolist(), counts.tolist(), firsts.tolist())
            ]
        return rows

    def touched_gens(self) -> list[int]:
        return [gen for table in self._tables.values() for gen in table.touched_gens()]

    def lookup_counters(self) -> dict[str, int]:
        """Lookups, hit and miss chunks the clients counted, over every table, open or closed (each saturated)."""
        counted = dict(self.closed_counters)
        for table in self._tables.values():
            for name, word in _COUNTERS.items():
                counted[name] = saturated(counted[name] + saturated(table.word(word)))
        return counted

    def close(self) -> None:
        self.keep_tables_of(())
