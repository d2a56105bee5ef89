"""Lookups and leases that take no round trip: the pool's directory of committed pages, and one hold table per holder.

A lookup answered over the socket costs a round trip, and a round trip needs
both ends to run: beside busy neighbours on a small host each end waits for a
core (spin.py). A client that asks for it at hello (``Hello.direct``) gets two
more memfds: the **directory**, which it maps read-only (sealed against writable
mappings), and its holder's **hold table**, which it alone writes. It then
leases a fully committed chain by itself:

1. it reads each key's directory slot under the slot's sequence number (even:
   stable; odd: being written; a slot whose number changed while read was not
   read): where the page lies, its checksum, and the entry's *generation*, a
   number the pool never gives to two entries;
2. it writes a hold (lease id, then generation) into its hold table;
3. it reads the slot's sequence number again: unchanged, the lease holds; changed,
   the entry left the directory meanwhile, and the client takes the round trip.

A key not in the directory ends the chain there (the longest committed prefix, as
the pool's own lookup answers) only while the directory holds every committed
entry (its header counts those it could not place: a full bucket) and the pool
has no remote tier (whose lookups promote what the arena lacks); else the lookup
takes the round trip.

The pool never frees or reuses the page of an entry that was published here until
no live hold names its generation. When an entry leaves (eviction, drop, flush)
the pool (a) takes it out of its slot, (b) runs membarrier(GLOBAL_EXPEDITED),
which executes a full memory barrier on every CPU running a registered process
(clients register before they map: ``register_client``), and (c) scans the hold
tables. Either the client's hold was visible to (c), or the client's step 3 ran
after (b) and so after (a), and it saw the slot change: a page is freed only when
no reader can still be using it (the asymmetric-fence pattern of liburcu). A hold
ends when the client clears it (its copies have ended), when the pool has seen it
for longer than a lease's TTL (lease_ttl_s; timed by the pool's clock, never the
client's), or when its holder is forgotten (holders.py: a Goodbye, or the process
is gone).

The scheme relies on x86-64's ordering of plain stores and loads (TSO) and on
membarrier; elsewhere the pool offers no directory and every lookup takes the
round trip. A hold table is the client's own and the pool trusts nothing in it
beyond "these generations may be read": garbage there pins pages at most until
the TTL, as leases can. Eviction does not see direct holds before it picks a
victim: a page read that way may be taken out of view while read (it stays
allocated until the hold ends); the client's touches (a ring in its table) keep
what it reads at the recent end of the LRU order, as a lookup does.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import platform
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from kvshare.pool.arena import SIZE_SEALS

log = logging.getLogger("kvshare.pool")

# One directory slot: 8 little-endian u64 words, 4 slots to a bucket, bucket = key's low word & mask.
SLOT_WORDS = 8
SEQ, KEY_LO, KEY_HI, OFFSET, PAGE_BYTES, CHECKSUM, CHECKSUM_KIND, GEN = range(SLOT_WORDS)
BUCKET_SLOTS = 4
# A hold table: a header, a ring of touched generations, then the holds (generation, lease id).
HEADER_WORDS = 8
# header words: holds in use lie below hwm; counters; touches written
HWM, LOOKUPS, HIT_CHUNKS, TOUCHES, MISS_CHUNKS = range(5)
DIRECTORY_HEADER_WORDS = SLOT_WORDS  # after the slots: the committed entries the directory lacks (a full bucket)
UNPLACED = 0
TOUCH_RING = 1024
HOLD_WORDS = 2
HOLD_GEN, HOLD_LEASE = range(HOLD_WORDS)
DEFAULT_HOLDS = 4096  # holds one holder may have at once (pages leased); more take the round trip

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_MEMBARRIER_NR = {"x86_64": 324, "AMD64": 324}
MEMBARRIER_CMD_GLOBAL_EXPEDITED = 1 << 1
MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED = 1 << 2


def membarrier(cmd: int) -> bool:
    """Run membarrier(``cmd``); False where this machine cannot (another architecture, an old kernel, seccomp)."""
    nr = _MEMBARRIER_NR.get(platform.machine())
    if nr is None or os.name != "posix":
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(nr, cmd, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_supported() -> bool:
    """Whether this machine can offer direct lookups: x86-64 (its store and load order) with membarrier."""
    return platform.machine() in _MEMBARRIER_NR and membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)


def register_client() -> bool:
    """Ask that the pool's barriers reach this process's CPUs; without it, a client must not read the directory."""
    return membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED)


SLOT_BYTES = SLOT_WORDS * 8
WORD = struct.Struct("<Q")  # one little-endian u64 word of the directory or a hold table
_BODY = struct.Struct("<16s5Q")  # a slot after its sequence number: the key (its two words), then the rest in order
assert (KEY_LO, KEY_HI, OFFSET, PAGE_BYTES, CHECKSUM, CHECKSUM_KIND, GEN) == tuple(range(1, SLOT_WORDS))


def _word_at(mapping, slot: int, word: int) -> int:
    return WORD.unpack_from(mapping, slot * SLOT_BYTES + word * 8)[0]


def directory_slots(arena_bytes: int) -> int:
    """Slots for an arena: one per 32 KiB of arena, a power of two between 4096 and 2**20 (at most 64 MiB)."""
    wanted = max(4096, min(1 << 20, arena_bytes // (32 << 10)))
    return 1 << (wanted - 1).bit_length()


def directory_bytes(num_slots: int) -> int:
    return (num_slots * SLOT_WORDS + DIRECTORY_HEADER_WORDS) * 8


def hold_table_bytes(num_holds: int) -> int:
    return (HEADER_WORDS + TOUCH_RING + num_holds * HOLD_WORDS) * 8


def _memfd(name: str, num_bytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, num_bytes)
        mapping = mmap.mmap(fd, num_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping


@dataclass(eq=False)
class _HoldTable:
    fd: int
    mapping: mmap.mmap
    words: np.ndarray  # the whole table as u64
    holds: np.ndarray  # [num_holds, HOLD_WORDS] view
    touches_read: int = 0
    first_seen: dict = field(default_factory=dict)  # (hold slot, generation, lease id) -> when the pool first saw it


class DirectTables:
    """The daemon's side: the directory it publishes committed entries in, and the hold tables it reads."""

    def __init__(self, arena_bytes: int, hold_ttl_s: float, num_holds: int = DEFAULT_HOLDS) -> None:
        self.num_slots = directory_slots(arena_bytes)
        self.num_holds = num_holds
        self.hold_ttl_s = hold_ttl_s
        self._mask = self.num_slots // BUCKET_SLOTS - 1
        self.fd, self._mapping = _memfd("kvshare-directory", directory_bytes(self.num_slots))
        # Clients may map it only read-only from now on (the pool's own mapping stays writable).
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SIZE_SEALS | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        words = np.frombuffer(self._mapping, dtype="<u8")
        self.header = words[self.num_slots * SLOT_WORDS :]
        self._slot_of: dict[bytes, int] = {}  # published key -> slot
        self._by_gen: dict[int, object] = {}  # published generation -> entry (for touches)
        self._next_gen = 1
        self._tables: dict[int, _HoldTable] = {}  # holder id -> its hold table
        self.counters = {"lookups": 0, "hit_chunks": 0, "miss_chunks": 0}  # of hold tables already closed
        self.unpublished_full = 0  # entries not published (their bucket was full), ever
        self._unplaced: set[bytes] = set()  # keys of committed entries not published: misses take the round trip

    # -- the directory ---------------------------------------------------------------

    def publish(self, entries) -> None:
        """Make committed entries readable without a round trip (each gets a new generation). Plain struct writes
        on the mapping, in order: the sequence number odd, the slot, the number even (a few us an entry)."""
        mapping = self._mapping
        for entry in entries:
            first = (int.from_bytes(entry.key[:8], "little") & self._mask) * BUCKET_SLOTS
            free = next((s for s in range(first, first + BUCKET_SLOTS) if not _word_at(mapping, s, GEN)), None)
            if free is None:
                self.unpublished_full += 1
                self._unplaced.add(entry.key)
                self.header[UNPLACED] = len(self._unplaced)
                continue
            entry.gen, self._next_gen = self._next_gen, self._next_gen + 1
            at, seq = free * SLOT_BYTES, _word_at(mapping, free, SEQ)
            WORD.pack_into(mapping, at, seq + 1)  # odd: being written
            fields = (entry.offset, entry.page_bytes, entry.checksum, int(entry.checksum_kind), entry.gen)
            _BODY.pack_into(mapping, at + KEY_LO * 8, entry.key, *fields)
            WORD.pack_into(mapping, at, seq + 2)
            self._slot_of[entry.key] = free
            self._by_gen[entry.gen] = entry

    def unpublish(self, entry) -> None:
        """Take an entry out of the directory (a reader that sees the slot change leases nothing)."""
        if entry.key in self._unplaced and not entry.gen:
            self._unplaced.discard(entry.key)
            self.header[UNPLACED] = len(self._unplaced)
        slot = self._slot_of.pop(entry.key, None)
        if slot is None or self._by_gen.get(entry.gen) is not entry:
            return
        del self._by_gen[entry.gen]
        at, seq = slot * SLOT_BYTES, _word_at(self._mapping, slot, SEQ)
        WORD.pack_into(self._mapping, at, seq + 1)
        _BODY.pack_into(self._mapping, at + KEY_LO * 8, bytes(16), 0, 0, 0, 0, 0)
        WORD.pack_into(self._mapping, at, seq + 2)

    # -- hold tables -------------------------------------------------------------------

    def hold_table(self, holder_id: int) -> int:
        """The memfd of a holder's hold table (made at its first hello; the same one after a reconnect)."""
        table = self._tables.get(holder_id)
        if table is None:
            fd, mapping = _memfd("kvshare-holds", hold_table_bytes(self.num_holds))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
            words = np.frombuffer(mapping, dtype="<u8")
            holds = words[HEADER_WORDS + TOUCH_RING :].reshape(self.num_holds, HOLD_WORDS)
            table = self._tables[holder_id] = _HoldTable(fd, mapping, words, holds)
        return table.fd

    def keep_tables_of(self, holder_ids) -> None:
        """Close the hold tables of holders no longer known (their holds have ended: holders.py says when)."""
        for holder_id in [h for h in self._tables if h not in holder_ids]:
            table = self._tables.pop(holder_id)
            for name, word in (("lookups", LOOKUPS), ("hit_chunks", HIT_CHUNKS), ("miss_chunks", MISS_CHUNKS)):
                self.counters[name] += int(table.words[word])
            os.close(table.fd)
            del table.holds, table.words
            table.mapping.close()

    def unheld(self, entries: list, now: float | None = None) -> list:
        """Those of ``entries`` (all out of the directory) that no live hold names: their pages may be freed."""
        if not self._tables:
            return list(entries)
        if not membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED):
            raise RuntimeError("membarrier failed after the directory was offered: pages held directly stay held")
        held = self.held_gens(time.monotonic() if now is None else now)
        return [entry for entry in entries if entry.gen not in held]

    def held_gens(self, now: float) -> set[int]:
        """Generations named by a live hold in any table."""
        return {gen for table in self._tables.values() for gen, _lease in self._live(table, now)}

    def live_holds(self, now: float, holder_id: int | None = None) -> int:
        """Live direct holds (pages) in every table, or in the holder's."""
        return sum(len(self._live(t, now)) for h, t in self._tables.items() if holder_id in (None, h))

    def live_leases(self, now: float) -> int:
        """Direct leases (lease ids with a live hold) over every table; for stats, beside the pool's own."""
        return sum(len({lease for _gen, lease in self._live(table, now)}) for table in self._tables.values())

    def _live(self, table: _HoldTable, now: float) -> list[tuple[int, int]]:
        """(generation, lease id) of the table's live holds: set, and first seen by the pool less than the TTL ago.
        What a table says is bounded (its hwm), never trusted: garbage there pins at most the pages it names."""
        holds = table.holds[: min(int(table.words[HWM]), self.num_holds)]
        slots = np.flatnonzero(holds[:, HOLD_GEN])
        seen = {}
        for slot, (gen, lease) in zip(slots.tolist(), holds[slots].tolist()):
            seen[(slot, gen, lease)] = table.first_seen.get((slot, gen, lease), now)
        table.first_seen = seen
        return [(gen, lease) for (_slot, gen, lease), first in seen.items() if now - first < self.hold_ttl_s]

    def lease_rows(self, now: float) -> list[tuple[int, int, int, float]]:
        """(lease id, holder id, pages, seconds since the pool first saw it) of every live direct lease."""
        rows = []
        for holder_id, table in self._tables.items():
            self._live(table, now)  # brings first_seen up to date
            firsts: dict[int, list[float]] = {}
            for (_slot, _gen, lease), first in table.first_seen.items():
                if now - first < self.hold_ttl_s:
                    firsts.setdefault(lease, []).append(first)
            rows += [(lease, holder_id, len(seen), now - min(seen)) for lease, seen in firsts.items()]
        return rows

    def touched(self) -> list:
        """Entries the clients read since the last call, in the order read (for the LRU order)."""
        touched = []
        for table in self._tables.values():
            written = int(table.words[TOUCHES])
            start = max(table.touches_read, written - TOUCH_RING)
            for i in range(start, written):
                entry = self._by_gen.get(int(table.words[HEADER_WORDS + i % TOUCH_RING]))
                if entry is not None:
                    touched.append(entry)
            table.touches_read = written
        return touched

    def tick(self, index, holder_ids) -> None:
        """What clients read moves up the LRU order; tables of forgotten holders close; ended holds free pages."""
        index.touch(self.touched())
        self.keep_tables_of(holder_ids)
        index.retired.settle()

    def lookup_counters(self) -> dict[str, int]:
        """Lookups, hit and miss chunks answered from the directory, over every table, open or closed."""
        words = {"lookups": LOOKUPS, "hit_chunks": HIT_CHUNKS, "miss_chunks": MISS_CHUNKS}
        return {
            name: self.counters[name] + sum(int(t.words[w]) for t in self._tables.values()) for name, w in words.items()
        }

    def close(self) -> None:
        self.keep_tables_of(())
        del self.header
        self._mapping.close()
        os.close(self.fd)


def open_direct(arena_bytes: int, hold_ttl_s: float, num_holds: int = DEFAULT_HOLDS) -> DirectTables | None:
    """The directory and hold tables where this machine supports them (x86-64, membarrier, sealable memfds), else
    None: every lookup then takes the round trip."""
    try:
        if is_supported():
            return DirectTables(arena_bytes, hold_ttl_s, num_holds)
    except OSError as exc:
        log.info("no direct lookups: %s", exc)
        return None
    log.info("no direct lookups on this machine (%s, no membarrier)", platform.machine())
    return None


def direct_lease_rows(retired) -> list[tuple[int, int, int, float]]:
    """DirectTables.lease_rows of the index's RetiredPages' directory; none without the directory."""
    return [] if retired.direct is None else retired.direct.lease_rows(time.monotonic())


def add_direct_stats(stats: dict, retired) -> dict:
    """The pool's stats with the lookups answered from the directory counted in, and a ``direct`` section (none
    without the directory). ``retired``: the index's RetiredPages."""
    direct = retired.direct
    if direct is None:
        return stats
    counted = direct.lookup_counters()
    now = time.monotonic()
    for name, count in counted.items():
        stats[name] += count
    stats["leases"] += direct.live_leases(now)  # a lease is a lease, whichever way it was taken
    stats["direct"] = {
        **counted,
        "holds": direct.live_holds(now),
        "retired_pages": len(retired.entries),  # out of view, kept while a direct hold may read them
        "unpublished": direct.unpublished_full,
    }
    return stats
