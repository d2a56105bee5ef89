"""A client's side of direct lookups (direct.py): lease a fully committed chain from the directory, no round trip.

Steps and why they are safe: direct.py. Anything short of a full hit (a miss, a
slot being written, an entry leaving while leased, a table the pool closed, no free
hold) returns None and the caller asks the pool over the socket, which also counts
misses and promotes from the remote tier.

A table belongs to the process that mapped it: a forked child inherits the mapping
but not the right to write it (its copy of the free-hold list would hand out the
slots of its parent's holds), so in any other process every lookup returns None,
no release clears a hold and ``close`` unmaps only.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading

from kvshare.pool import protocol as P
from kvshare.pool.direct import (
    BUCKET_SLOTS,
    CHECKSUM,
    CHECKSUM_KIND,
    GEN,
    KEY_HI,
    KEY_LO,
    OFFSET,
    PAGE_BYTES,
    SLOT_BYTES,
    SLOT_WORDS,
    UNPLACED,
    WORD,
    directory_bytes,
)
from kvshare.pool.forks import fork_count
from kvshare.pool.grants import LeaseGrant
from kvshare.pool.hold_tables import (
    CLOSED,
    HEADER_WORDS,
    HIT_CHUNKS,
    HOLD_GEN,
    HOLD_LEASE,
    HOLD_WORDS,
    HOLDS_AT_WORD,
    HWM,
    LOOKUPS,
    MISS_CHUNKS,
    TOUCH_RING,
    TOUCHES,
    hold_table_bytes,
)

# Lease ids of direct leases: far above any id the pool gives (they count up from 1 per daemon).
DIRECT_LEASE_BIT = 1 << 62


_HOLD = struct.Struct("<QQ")  # generation, lease id
_COUNTERS = struct.Struct("<4Q")  # lookups, hit chunks, touches written, miss chunks: header words in a row
assert (HOLD_GEN, HOLD_LEASE) == (0, 1), "direct.py's layout"
assert (HIT_CHUNKS, TOUCHES, MISS_CHUNKS) == (LOOKUPS + 1, LOOKUPS + 2, LOOKUPS + 3), "direct.py's layout"
_BODY = struct.Struct(f"<{SLOT_WORDS}Q")  # a slot's words
BUCKET_BYTES = BUCKET_SLOTS * SLOT_BYTES
HOLDS_AT = HOLDS_AT_WORD * 8  # byte offset of the first hold in a table


class DirectLeases:
    """The directory (read-only) and this holder's hold table (written only here), as a client maps them.

    Plain struct reads and writes on the mappings, in program order (x86-64 keeps stores in order, and loads in
    order, which is what direct.py's argument needs): a lookup of a few keys costs a few microseconds.
    """

    def __init__(
        self,
        directory_fd: int,
        num_slots: int,
        table_fd: int,
        num_holds: int,
        pool_id: bytes,
        answers_misses: bool = False,
    ) -> None:
        self.pool_id = pool_id
        self.answers_misses = answers_misses  # the pool has no remote tier: a key it lacks is a miss (direct.py)
        self._header_at = num_slots * SLOT_BYTES
        self._dir = mmap.mmap(directory_fd, directory_bytes(num_slots), mmap.MAP_SHARED, mmap.PROT_READ)
        self._table = mmap.mmap(table_fd, hold_table_bytes(num_holds), mmap.MAP_SHARED)
        self.table_inode = os.fstat(table_fd).st_ino  # which table: the pool makes a new one for a new holder
        self._mask = num_slots // BUCKET_SLOTS - 1
        # A table kept from an earlier connection of this holder may hold live holds: their slots stay taken.
        hwm = min(self._word(HWM), num_holds)
        in_use = {i for i in range(hwm) if WORD.unpack_from(self._table, HOLDS_AT + i * HOLD_WORDS * 8)[0]}
        self._free = [i for i in range(num_holds - 1, -1, -1) if i not in in_use]  # lowest slot popped first
        self._hwm = hwm
        self._leases: dict[int, list[int]] = {}  # lease id -> its hold slots
        self._next_lease = DIRECT_LEASE_BIT + 1
        self._lock = threading.Lock()  # one lookup or release at a time (a PoolClient is used from several threads)
        self.owner = fork_count()  # the one process that writes this table (a forked child only reads its own pages)
        self.is_closed = False
        self.on_close = lambda: None

    def lookup(self, keys: list[bytes], page_bytes: int) -> LeaseGrant | None:
        """A lease on every key's page, or None (take the round trip)."""
        with self._lock:
            return None if self.is_closed or fork_count() != self.owner else self._lookup(keys, page_bytes)

    def _lookup(self, keys: list[bytes], page_bytes: int) -> LeaseGrant | None:
        if not keys or len(keys) > len(self._free):
            return None
        read = self._read_chain(keys, page_bytes)
        if read is None:
            return None
        if not read:
            self._count([], len(keys))
            return LeaseGrant(lease_id=0, pages=[])
        lease_id = self._hold(read)
        if lease_id is None:
            return None
        self._count([words[GEN] for _slot, _seq, words in reversed(read)], len(keys) - len(read))
        version = P.FORMAT_VERSION
        return LeaseGrant(
            lease_id=lease_id,
            pages=[
                P.PageHeader(
                    offset=w[OFFSET],
                    page_bytes=w[PAGE_BYTES],
                    checksum=w[CHECKSUM],
                    format_version=version,
                    checksum_kind=w[CHECKSUM_KIND],
                )
                for _s, _q, w in read
            ],
        )

    def _read_chain(self, keys: list[bytes], page_bytes: int) -> list[tuple[int, int, tuple]] | None:
        """(slot offset, sequence number, slot words) of the longest prefix of ``keys`` committed in the directory,
        or None where that prefix is not sure (a slot being written, a key not placed: take the round trip)."""
        directory, mask, unpack_word, unpack_slot = self._dir, self._mask, WORD.unpack_from, _BODY.unpack_from
        read = []  # (slot offset, sequence number, slot words) per key
        for key in keys:
            bucket = (int.from_bytes(key[:8], "little") & mask) * BUCKET_BYTES
            at = directory.find(key, bucket, bucket + BUCKET_BYTES)
            while at >= 0 and (at - bucket) % SLOT_BYTES != KEY_LO * 8:
                at = directory.find(key, at + 1, bucket + BUCKET_BYTES)
            if len(key) != 16:  # the pool's own lookup says what is wrong
                return None
            if at < 0:  # not committed, or not placed in the directory: the prefix ends only if the former is sure
                if self._is_miss_sure():
                    break
                return None
            slot = at - KEY_LO * 8
            seq = unpack_word(directory, slot)[0]  # the number first, then the slot, then the number again
            raw = directory[slot : slot + SLOT_BYTES]
            words = unpack_slot(raw)
            if seq & 1 or raw[KEY_LO * 8 : KEY_HI * 8 + 8] != key or words[GEN] == 0:
                return None
            if words[PAGE_BYTES] != page_bytes:  # pages of another size: a miss, as the pool's own lookup says
                if self._is_miss_sure():
                    break
                return None
            read.append((slot, seq, words))
        return read

    def _hold(self, read: list[tuple[int, int, tuple]]) -> int | None:
        """Write a hold on every slot ``read`` in this holder's table, then check each slot's number again; the
        new lease's id, or None (its holds cleared again) when an entry left meanwhile or the pool closed the table."""
        directory, table = self._dir, self._table
        held = [self._free.pop() for _ in read]
        if max(held) >= self._hwm:
            self._hwm = max(held) + 1
            WORD.pack_into(table, HWM * 8, self._hwm)  # before the holds: the pool scans the table below it
        lease_id, self._next_lease = self._next_lease, self._next_lease + 1
        for (_slot, _seq, words), hold in zip(read, held):  # a hold is visible once its generation (one word) is
            _HOLD.pack_into(table, HOLDS_AT + hold * HOLD_WORDS * 8, words[GEN], lease_id)
        for slot, seq, _words in read:
            if WORD.unpack_from(directory, slot)[0] != seq:  # the entry left while the hold was taken: lease nothing
                self._clear(held)
                return None
        if WORD.unpack_from(table, CLOSED * 8)[0]:  # the pool closed the table to new holds (a dropped link)
            self._clear(held)
            return None
        self._leases[lease_id] = held
        return lease_id

    def release(self, lease_id: int) -> bool:
        """End a direct lease (its copies have ended); False when it is not one of ours."""
        with self._lock:
            held = None if self.is_closed or fork_count() != self.owner else self._leases.pop(lease_id, None)
            if held is not None:
                self._clear(held)
        return held is not None

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def _word(self, index: int) -> int:
        return WORD.unpack_from(self._table, index * 8)[0]

    def _clear(self, held: list[int]) -> None:
        for hold in held:
            WORD.pack_into(self._table, HOLDS_AT + hold * HOLD_WORDS * 8 + HOLD_GEN * 8, 0)
        self._free.extend(sorted(held, reverse=True))

    def _is_miss_sure(self) -> bool:
        """Whether a key not in the directory is not committed: the pool has no remote tier to promote it from, and
        every committed entry is in the directory (none left out for a full bucket)."""
        return self.answers_misses and WORD.unpack_from(self._dir, self._header_at + UNPLACED * 8)[0] == 0

    def _count(self, gens: list[int], num_missed: int) -> None:
        """Count the lookup and its pages, and tell the pool which entries were read, tail first (as a lookup moves
        them in the LRU order): the touch ring, then the counters."""
        lookups, hits, written, missed = _COUNTERS.unpack_from(self._table, LOOKUPS * 8)
        touched = gens[-TOUCH_RING:]
        first = written % TOUCH_RING
        if not touched:
            _COUNTERS.pack_into(self._table, LOOKUPS * 8, lookups + 1, hits, written, missed + num_missed)
            return
        head = touched[: TOUCH_RING - first]  # up to the ring's end, then the rest from its start
        struct.pack_into(f"<{len(head)}Q", self._table, (HEADER_WORDS + first) * 8, *head)
        if len(touched) > len(head):
            struct.pack_into(f"<{len(touched) - len(head)}Q", self._table, HEADER_WORDS * 8, *touched[len(head) :])
        _COUNTERS.pack_into(
            self._table, LOOKUPS * 8, lookups + 1, hits + len(gens), written + len(touched), missed + num_missed
        )

    def close(self, end_holds: bool = True, unmap: bool | None = None) -> None:
        """End every hold with ``end_holds`` (the caller says its copies have ended) and unmap. Without it the holds
        stay in the table, which the pool reads while this process lives or until their TTL, and the mapping stays
        for the next client of this holder (map_direct), unless ``unmap``."""
        for lease_id in list(self._leases) if end_holds else ():
            self.release(lease_id)
        if not (end_holds if unmap is None else unmap):
            return
        self.is_closed = True
        self.on_close()
        self._dir.close()
        self._table.close()


# (pool id, holder token, pid) -> the mapping every client of that holder in this process shares: a client made
# after a timeout (PoolLink) releases the direct leases its predecessor took. The pid keeps a forked child, which
# inherits this dict and the mappings, off its parent's table (the pool gives the child a holder of its own).
_SHARED: dict[tuple[bytes, bytes, int], DirectLeases] = {}


def map_direct(reply: P.HelloReply, fds: list[int], holder: bytes) -> DirectLeases | None:
    """The directory and the holder's hold table when the pool sent them (``fds``, after the arena's); the mapping
    an earlier client of the same holder made while the pool still reads that table. A pool that forgot the holder
    (no holds were left) sends a new table: holds written into the old one would be seen by nobody."""
    if not reply.direct_slots or len(fds) != 2:
        return None
    key = (reply.pool_id, holder, os.getpid())
    current = _SHARED.get(key)
    if current is not None and not current.is_closed and current.table_inode == os.fstat(fds[1]).st_ino:
        return current
    if current is not None and not current.is_closed:
        current.close(end_holds=False, unmap=True)
    leases = DirectLeases(
        fds[0], reply.direct_slots, fds[1], reply.direct_holds, reply.pool_id, answers_misses=reply.direct_misses
    )
    _SHARED[key] = leases
    leases.on_close = lambda: _SHARED.pop(key, None) if _SHARED.get(key) is leases else None
    return leases
