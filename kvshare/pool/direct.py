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

The pool never frees or reuses the page of an entry that was published here while
a hold may name it. When an entry leaves (eviction, drop, flush) the pool (a) takes
it out of its slot, (b) runs membarrier(GLOBAL_EXPEDITED), which executes a full
memory barrier on every CPU running a registered process (clients register before
they map: ``register_client``), and (c) scans the hold tables. Either the client's
hold was visible to (c), or the client's step 3 ran after (b) and so after (a), and
it saw the slot change: a page is freed only when no reader can still be using it
(the asymmetric-fence pattern of liburcu). So the holds (c) saw are the only ones
that keep the page (hold_tables.py): each until its client clears or changes it
(its copies have ended), the pool has seen it for longer than a lease's TTL
(lease_ttl_s, by the pool's clock from its first sight of that hold), or its
holder is forgotten (holders.py: a Goodbye, or the process is gone). The same
fence closes a table before the pool forgets a holder whose process lives (a
dropped link): the CLOSED word, the barrier, a last scan; a client checks CLOSED
in step 3 too.

The scheme relies on x86-64's ordering of plain stores and loads (TSO) and on
membarrier; elsewhere the pool offers no directory and every lookup takes the
round trip. A hold table is the client's own and the pool reads it as if the
client were hostile (hold_tables.py: copied before scanned, bounded, timed by the
pool). Eviction skips the pages a scan finds held (it would free nothing with
them); the client's touches (a ring in its table) keep what it reads at the recent
end of the LRU order, as a lookup does. A table belongs to one process: a forked
child's client reads no directory and writes no table (direct_reader.py).
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

import numpy as np

from kvshare.pool.arena import SIZE_SEALS
from kvshare.pool.hold_tables import DEFAULT_HOLDS, HoldRef, HoldTables

log = logging.getLogger("kvshare.pool")

# One directory slot: 8 little-endian u64 words, 4 slots to a bucket, bucket = key's low word & mask.
SLOT_WORDS = 8
SEQ, KEY_LO, KEY_HI, OFFSET, PAGE_BYTES, CHECKSUM, CHECKSUM_KIND, GEN = range(SLOT_WORDS)
BUCKET_SLOTS = 4
DIRECTORY_HEADER_WORDS = SLOT_WORDS  # after the slots: the committed entries the directory lacks (a full bucket)
UNPLACED = 0

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


def _memfd(name: str, num_bytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, num_bytes)
        mapping = mmap.mmap(fd, num_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping


class Directory:
    """The committed entries clients may lease without a round trip: a sealed memfd of slots the pool alone writes."""

    def __init__(self, arena_bytes: int) -> None:
        self.num_slots = directory_slots(arena_bytes)
        self._mask = self.num_slots // BUCKET_SLOTS - 1
        self.fd, self._mapping = _memfd("kvshare-directory", directory_bytes(self.num_slots))
        # Clients may map it only read-only from now on (the pool's own mapping stays writable).
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SIZE_SEALS | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        words = np.frombuffer(self._mapping, dtype="<u8")
        self.header = words[self.num_slots * SLOT_WORDS :]
        self._slot_of: dict[bytes, int] = {}  # published key -> slot
        self.by_gen: dict[int, object] = {}  # published generation -> entry (for touches)
        self._next_gen = 1
        self.unpublished_full = 0  # entries not published (their bucket was full), ever
        self._unplaced: set[bytes] = set()  # keys of committed entries not published: misses take the round trip

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
            self.by_gen[entry.gen] = entry

    def unpublish(self, entry) -> None:
        """Take an entry out of the directory (a reader that sees the slot change leases nothing)."""
        if entry.key in self._unplaced and not entry.gen:
            self._unplaced.discard(entry.key)
            self.header[UNPLACED] = len(self._unplaced)
        slot = self._slot_of.pop(entry.key, None)
        if slot is None or self.by_gen.get(entry.gen) is not entry:
            return
        del self.by_gen[entry.gen]
        at, seq = slot * SLOT_BYTES, _word_at(self._mapping, slot, SEQ)
        WORD.pack_into(self._mapping, at, seq + 1)
        _BODY.pack_into(self._mapping, at + KEY_LO * 8, bytes(16), 0, 0, 0, 0, 0)
        WORD.pack_into(self._mapping, at, seq + 2)

    def close(self) -> None:
        del self.header
        self._mapping.close()
        os.close(self.fd)


def barrier() -> None:
    """membarrier(GLOBAL_EXPEDITED): every store a registered client made before it is visible to the pool after."""
    if not membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED):
        raise RuntimeError("membarrier failed after the directory was offered: pages held directly stay held")


class DirectTables:
    """The daemon's side: the directory it publishes committed entries in, and the hold tables it reads."""

    def __init__(self, arena_bytes: int, hold_ttl_s: float, num_holds: int = DEFAULT_HOLDS) -> None:
        self.directory = Directory(arena_bytes)
        self.fd, self.num_slots = self.directory.fd, self.directory.num_slots
        self.num_holds = num_holds
        self.tables = HoldTables(num_holds, hold_ttl_s, barrier)
        # retired entries (out of the directory) -> the holds the first scan after the barrier saw on them
        self._holds_of: dict[object, list[HoldRef]] = {}

    def publish(self, entries) -> None:
        self.directory.publish(entries)

    def unpublish(self, entry) -> None:
        self.directory.unpublish(entry)

    def hold_table(self, holder_id: int, uid: int) -> int | None:
        """The memfd of a holder's hold table; None when its uid has as many as it may have (hold_tables.py)."""
        return self.tables.table_fd(holder_id, uid)

    def unheld(self, entries: list, now: float | None = None) -> list:
        """Those of ``entries`` (all out of the directory) that no hold counted for them names any more: their pages
        may be freed. An entry's holds are those the first scan after its retirement saw (after the barrier);
        each counts until its client clears it, its table closes, or it is older than the TTL."""
        now = time.monotonic() if now is None else now
        fresh = {entry.gen for entry in entries if entry not in self._holds_of}
        if fresh and len(self.tables):
            seen = self.tables.holds_naming(fresh, now)
            for entry in entries:
                self._holds_of.setdefault(entry, seen.get(entry.gen, []))
        unheld = []
        for entry in entries:
            refs = [ref for ref in self._holds_of.get(entry, ()) if self.tables.is_held(ref, now)]
            if refs:
                self._holds_of[entry] = refs
            else:
                self._holds_of.pop(entry, None)
                unheld.append(entry)
        return unheld

    def held_gens(self, now: float | None = None) -> set[int]:
        """Generations a direct hold names now (no barrier: eviction's hint of what is being read)."""
        return self.tables.held_gens(time.monotonic() if now is None else now) if len(self.tables) else set()

    def seal(self, holder_id: int) -> int:
        """The holder's live direct holds, its table closed to new ones first (hold_tables.HoldTables.seal)."""
        return self.tables.seal(holder_id, time.monotonic())

    def touched(self) -> list:
        """Entries the clients read since the last call, in the order read (for the LRU order)."""
        by_gen = self.directory.by_gen
        return [entry for gen in self.tables.touched_gens() if (entry := by_gen.get(gen)) is not None]

    def tick(self, index, holder_ids) -> None:
        """What clients read moves up the LRU order; tables of forgotten holders close; ended holds free pages."""
        index.touch(self.touched())
        self.tables.keep_tables_of(holder_ids)
        index.retired.settle()

    def lookup_counters(self) -> dict[str, int]:
        """Lookups, hit and miss chunks answered from the directory, over every table, open or closed."""
        return self.tables.lookup_counters()

    def close(self) -> None:
        self.tables.close()
        self.directory.close()


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
    """HoldTables.lease_rows of the index's RetiredPages' directory; none without the directory."""
    return [] if retired.direct is None else retired.direct.tables.lease_rows(time.monotonic())


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
    holds, leases = direct.tables.live_holds_and_leases(now)
    stats["leases"] += leases  # a lease is a lease, whichever way it was taken
    stats["direct"] = {
        **counted,
        "holds": holds,
        "tables": len(direct.tables),
        "retired_pages": len(retired.entries),  # out of view, kept while a direct hold may read them
        "unpublished": direct.directory.unpublished_full,
    }
    return stats
