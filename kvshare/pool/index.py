"""The pool's index: chunk key -> page, with visibility, leases and eviction.

State machine of one entry::

    reserve --> WRITING --commit--> COMMITTED --evict/drop--> (gone)
                   |                    ^  lookup leases it; a leased entry is never evicted
                   +--abort/disconnect--+-> (gone, page freed)

Only COMMITTED entries are visible to lookups. Eviction walks committed, unleased entries in LRU order
between a high and a low watermark. With a quota (quota.py, per account or else per namespace), a reserve
over it evicts that owner's own entries and grants fewer pages when that is not enough. A lookup touches its
matched chain from tail to head and a commit adds from tail to head, so in the LRU order a chain's tail is
always older than its head and is evicted first (evicting chunk i strands chunks i+1 and later).

Bookkeeping over an Allocator: no sockets, no clocks (callers pass ``now``); the only memory it touches is
the directory of direct lookups, through retiring.py.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvshare.keys import KEY_BYTES
from kvshare.pool.allocator import Allocator
from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.config import IndexConfig
from kvshare.pool.entries import (
    Entry,
    EntryState,
    IndexCounters,
    IndexListener,
    Lease,
    LookupResult,
    Reservation,
    ReserveResult,
)
from kvshare.pool.eviction import victims
from kvshare.pool.integrity import integrity_items
from kvshare.pool.quota import NamespaceQuota, namespace_rows
from kvshare.pool.retiring import RetiredPages

# Rounds of one eviction (index._evict): the first frees what it picks unless a reader holds it meanwhile.
MAX_EVICTION_ROUNDS = 4


class PoolError(Exception):
    """A request the index refuses; the message says why. The index is unchanged."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PoolIndex:
    """Key -> page map with leases, reservations and LRU eviction."""

    def __init__(self, allocator: Allocator, config: IndexConfig = IndexConfig()) -> None:
        self.allocator = allocator
        self.config = config
        self.counters = IndexCounters()
        self._entries: dict[bytes, Entry] = {}
        self._lru: OrderedDict[bytes, Entry] = OrderedDict()  # committed entries, oldest first
        self._leases: dict[int, Lease] = {}
        self._reservations: dict[int, Reservation] = {}
        self.quota = NamespaceQuota(config.namespace_quota_bytes)
        self._ids = itertools.count(1)  # lease and reservation ids
        self.listener: IndexListener | None = None
        self.retired = RetiredPages(self._free)  # out of view, pages kept while a direct hold may read them
        self.num_states = 0  # committed state checkpoints (Entry.is_state) and their bytes, among the entries
        self.state_bytes = 0

    # -- queries -------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        return len(self._lru)

    @property
    def num_writing(self) -> int:
        return len(self._entries) - len(self._lru)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    @property
    def num_namespaces(self) -> int:
        return len(self.quota)

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def entry(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def namespaces(self) -> list[tuple[bytes, int, int]]:
        """(namespace, committed entries, bytes held) of every namespace that holds pages, largest first."""
        return namespace_rows(self._entries.values())

    def accounts(self) -> list[tuple[bytes, int, int]]:
        """(quota owner, committed entries, bytes held) of every owner that holds pages, largest first."""
        return self.quota.rows(self._lru.values())

    # -- lookups and leases ----------------------------------------------------

    def lookup(
        self,
        client_id: int,
        keys: list[bytes],
        page_bytes: int,
        now: float,
        lease: bool = True,
        is_counted: bool = True,
        states: Sequence[tuple[bytes, int]] = (),
        state_page_bytes: int = 0,
    ) -> LookupResult:
        """Longest committed prefix of ``keys``; leased (pinned) when ``lease``.

        ``states``: a hybrid model's checkpoints (key, KV keys it needs), deepest first; the first committed one of
        ``state_page_bytes`` whose need the prefix meets is found and leased with it (protocol.Lookup).
        ``is_counted=False`` leaves the lookup counters alone: for the pool's own pins, and the second
        answer of a lookup deferred to the remote tier (counted once, when it came in).
        """
        self._check_keys(keys)
        matched: list[Entry] = []
        entries, committed = self._entries, EntryState.COMMITTED
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.state is not committed or entry.page_bytes != page_bytes:
                break
            matched.append(entry)
        state = self._deepest_state(states, len(matched), state_page_bytes) if states else None
        if is_counted:
            counters = self.counters
            counters.lookups += 1
            counters.hit_chunks += len(matched)
            counters.miss_chunks += len(keys) - len(matched)
            counters.state_lookups += bool(states)
            counters.state_hits += state is not None
        move_to_end = self._lru.move_to_end
        for entry in reversed(matched):  # tail first, so the head ends up most recent
            move_to_end(entry.key)
        held = matched if state is None else [*matched, state[1]]
        if state is not None:
            move_to_end(state[1].key)
        if not lease or not held:
            return LookupResult(lease_id=0, entries=matched, state=state)
        for entry in held:
            entry.num_leases += 1
        lease_id = next(self._ids)
        self._leases[lease_id] = Lease(lease_id, client_id, held, now, now + self.config.lease_ttl_s)
        return LookupResult(lease_id=lease_id, entries=matched, state=state)

    def _deepest_state(
        self, states: Sequence[tuple[bytes, int]], num_matched: int, page_bytes: int
    ) -> tuple[int, Entry] | None:
        """(index, entry) of the first committed state checkpoint in ``states`` that needs at most ``num_matched``
        KV keys; None when none is."""
        self._check_keys([key for key, _ in states])
        for index, (key, num_kv) in enumerate(states):
            entry = self._entries.get(key)
            if num_kv > num_matched or entry is None or entry.state is not EntryState.COMMITTED:
                continue
            if entry.is_state and entry.page_bytes == page_bytes:
                return index, entry
        return None

    def release(self, client_id: int, lease_id: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise PoolError("unknown_lease", f"lease {lease_id} does not exist (released, expired or never granted)")
        if lease.client_id != client_id:
            raise PoolError("not_owner", f"lease {lease_id} belongs to another client")
        self._end_lease(lease)

    def expire(self, now: float) -> int:
        """Release leases past their TTL (a reader that hung); returns how many."""
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            self._end_lease(lease)
        self.counters.expired_leases += len(expired)
        return len(expired)

    def expire_reservations(self, now: float, in_copy: Collection[int] = ()) -> list[int]:
        """Abort reservations older than ``reservation_ttl_s``, but none in ``in_copy`` (a copy into its pages may
        still run); returns their ids."""
        ttl_s = self.config.reservation_ttl_s
        stale = [
            r for r in self._reservations.values() if r.created_at + ttl_s <= now and r.reservation_id not in in_copy
        ]
        for reservation in stale:
            self._abort(reservation)
        self.counters.expired_reservations += len(stale)
        return [r.reservation_id for r in stale]

    def _end_lease(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        for entry in lease.entries:
            entry.num_leases -= 1
            if entry.is_dropped and entry.num_leases == 0:
                self.retired.retire(entry)
        self.retired.settle()

    # -- writes --------------------------------------------------------------

    def reserve(
        self,
        client_id: int,
        namespace: bytes,
        keys: list[bytes],
        page_bytes: int,
        first_depth: int,
        now: float,
        tokens_le32: bytes = b"",
        account: bytes = b"",
        parent_key: bytes = b"",
        holds_states: bool = False,
    ) -> ReserveResult:
        """Pages for the keys nobody holds yet, invisible until commit. Never blocks: no room -> fewer grants.

        ``tokens_le32``: the chunks' token ids (u32 LE, as many per key) or nothing; kept for KV events only.
        ``account``: whose quota the pages count against (quota.py), or nothing: the namespace's. ``parent_key``:
        the key of chunk ``first_depth - 1`` (KV events name it as the first page's parent), or nothing.
        ``holds_states``: the keys name state checkpoints, not chunks (entries.Entry.is_state).
        """
        self._check_reserve(namespace, keys, page_bytes, first_depth, tokens_le32, account, parent_key)
        chunk_bytes = len(tokens_le32) // len(keys) if tokens_le32 else 0
        wanted = [i for i, key in enumerate(keys) if key not in self._entries]
        if len(set(keys[i] for i in wanted)) != len(wanted):
            raise PoolError("duplicate_keys", "a reserve may not name the same key twice")
        if not wanted:
            return ReserveResult(reservation_id=0, grants=[], num_no_room=0)
        over_quota = 0
        if self.quota.is_limited:
            wanted, over_quota = self._fit_quota(account or namespace, keys, wanted, page_bytes)
            if not wanted:
                return ReserveResult(reservation_id=0, grants=[], num_no_room=over_quota)
        offsets = self._allocate(len(wanted), page_bytes)
        granted, no_room = wanted[: len(offsets)], len(wanted) - len(offsets)
        self.counters.skipped_stores += no_room
        no_room += over_quota
        if not granted:
            return ReserveResult(reservation_id=0, grants=[], num_no_room=no_room)
        reservation_id = next(self._ids)
        grants = []
        for i, offset in zip(granted, offsets):
            entry = Entry(
                keys[i],
                namespace,
                offset,
                page_bytes,
                first_depth + i,
                EntryState.WRITING,
                reservation_id,
                parent_key=None if holds_states else keys[i - 1] if i > 0 else (parent_key or None),
                tokens_le32=tokens_le32[i * chunk_bytes : (i + 1) * chunk_bytes],
                account=account,
                is_state=holds_states,
            )
            self._entries[entry.key] = entry
            self.quota.add(entry.quota_owner, page_bytes)
            grants.append((i, entry))
        self._reservations[reservation_id] = Reservation(reservation_id, client_id, [e for _, e in grants], now)
        self.counters.reserved_pages += len(grants)
        return ReserveResult(reservation_id=reservation_id, grants=grants, num_no_room=no_room)

    def _check_reserve(
        self,
        namespace: bytes,
        keys: list[bytes],
        page_bytes: int,
        first_depth: int,
        tokens_le32: bytes,
        account: bytes,
        parent_key: bytes,
    ) -> None:
        """Raise PoolError for a reserve whose arguments the index refuses (before it changes anything)."""
        self._check_keys([*keys, parent_key] if parent_key else keys)
        if parent_key and first_depth == 0:
            raise PoolError("bad_parent", "a run that names a parent key starts past chunk 0")
        if tokens_le32 and len(tokens_le32) % (4 * len(keys)):
            raise PoolError("bad_token_ids", f"{len(tokens_le32)} token id bytes do not split over {len(keys)} keys")
        if len(namespace) != KEY_BYTES:
            raise PoolError("bad_namespace", f"namespace must be {KEY_BYTES} bytes, got {len(namespace)}")
        if account and len(account) != KEY_BYTES:
            raise PoolError("bad_account", f"account must be {KEY_BYTES} bytes or empty, got {len(account)}")
        if first_depth < 0:
            raise PoolError("bad_depth", f"first_depth must be >= 0, got {first_depth}")
        try:
            self.allocator.check_page_size(page_bytes)
        except ValueError as exc:
            raise PoolError("bad_page_size", str(exc)) from None

    def _allocate(self, num_pages: int, page_bytes: int) -> list[int]:
        """Offsets of up to ``num_pages`` free pages of ``page_bytes``, evicting (LRU) for those missing first."""
        if self.allocator.num_free_pages(page_bytes) < num_pages:
            self._evict(lambda: (num_pages - self.allocator.num_free_pages(page_bytes)) * page_bytes, page_bytes)
        runs = self.allocator.allocate(page_bytes, num_pages)
        return [run.page_offset(i) for run in runs for i in range(run.num_pages)]

    def commit(
        self, client_id: int, reservation_id: int, checksums: list[int], checksum_kind: ChecksumKind = ChecksumKind.XXH3
    ) -> int:
        """Make a reservation's pages visible with their checksums (all of one kind); returns pages committed."""
        reservation = self._owned_reservation(client_id, reservation_id)
        if len(checksums) != len(reservation.entries):
            raise PoolError("bad_checksums", f"commit needs {len(reservation.entries)} checksums, got {len(checksums)}")
        del self._reservations[reservation_id]
        for entry, checksum in zip(reservation.entries, checksums):
            entry.state = EntryState.COMMITTED
            entry.checksum = checksum
            entry.checksum_kind = checksum_kind
        for entry in sorted(reservation.entries, key=lambda e: -e.depth):  # tail first: head most recent
            self._lru[entry.key] = entry
            if entry.is_state:
                self.num_states += 1
                self.state_bytes += entry.page_bytes
        self.counters.committed_pages += len(reservation.entries)
        if self.listener is not None:
            self.listener.committed(reservation.entries)
        self.retired.published(reservation.entries)
        self._evict_above_watermark()
        return len(reservation.entries)

    def abort(self, client_id: int, reservation_id: int) -> int:
        reservation = self._owned_reservation(client_id, reservation_id)
        self._abort(reservation)
        return len(reservation.entries)

    def _abort(self, reservation: Reservation) -> None:
        del self._reservations[reservation.reservation_id]
        for entry in reservation.entries:
            del self._entries[entry.key]
            self._free(entry)
        self.counters.aborted_pages += len(reservation.entries)

    def _owned_reservation(self, client_id: int, reservation_id: int) -> Reservation:
        reservation = self._reservations.get(reservation_id)
        if reservation is None:
            raise PoolError(
                "unknown_reservation", f"reservation {reservation_id} does not exist (committed, aborted or never made)"
            )
        if reservation.client_id != client_id:
            raise PoolError("not_owner", f"reservation {reservation_id} belongs to another client")
        return reservation

    # -- clients, eviction, administration ---------------------------------------

    def num_holds(self, client_id: int) -> int:
        """The client's leases and reservations (its direct holds: RetiredPages.seal)."""
        holders = [h.client_id for h in self._leases.values()] + [h.client_id for h in self._reservations.values()]
        return holders.count(client_id)

    def disconnect(self, client_id: int) -> tuple[int, int]:
        """A holder is done or gone (its process exited): abort its reservations, release its leases."""
        reservations = [r for r in self._reservations.values() if r.client_id == client_id]
        for reservation in reservations:
            self._abort(reservation)
        leases = [lease for lease in self._leases.values() if lease.client_id == client_id]
        for lease in leases:
            self._end_lease(lease)
        return len(reservations), len(leases)

    def drop(self, keys: list[bytes]) -> int:
        """Remove committed entries from view (a bad chunk); a leased page is freed after its last lease."""
        self._check_keys(keys)
        dropped = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.state is EntryState.COMMITTED:
                self._remove_committed(entry)
                dropped += 1
        self.counters.dropped_pages += dropped
        self.retired.settle()
        return dropped

    def flush(self, namespace: bytes | None = None) -> int:
        """Drop every committed entry (of one namespace when given); returns how many."""
        entries = [e for e in self._lru.values() if namespace is None or e.namespace == namespace]
        for entry in entries:
            self._remove_committed(entry)
        self.counters.dropped_pages += len(entries)
        self.retired.settle()
        return len(entries)

    def _remove_committed(self, entry: Entry) -> int:
        """Take an entry out of view; returns the bytes retired (kept until settle frees them)."""
        del self._entries[entry.key]
        del self._lru[entry.key]
        if entry.is_state:
            self.num_states -= 1
            self.state_bytes -= entry.page_bytes
        if self.listener is not None:
            self.listener.removed(entry)
        self.retired.unpublished(entry)
        if entry.num_leases:
            entry.is_dropped = True
            return 0
        return self.retired.retire(entry)

    def touch(self, entries: list[Entry]) -> None:
        """Entries read through the directory, in the order read: the recent end of the LRU order, as a lookup."""
        for entry in (e for e in entries if self._lru.get(e.key) is e):
            self._lru.move_to_end(entry.key)

    def _free(self, entry: Entry) -> None:
        """Give an entry's page back to the allocator and take it off its owner's bytes."""
        self.allocator.free(entry.offset, entry.page_bytes)
        self.quota.remove(entry.quota_owner, entry.page_bytes)

    def _fit_quota(self, owner: bytes, keys: list[bytes], wanted: list[int], page_bytes: int) -> tuple[list[int], int]:
        """Make room under the owner's quota from its own LRU entries; returns (wanted that fit, pages over)."""
        for entry in self.quota.victims(owner, set(keys), len(wanted) * page_bytes, self._lru.values()):
            self._remove_committed(entry)
            self.counters.quota_evictions += 1
            self.counters.evicted_bytes += entry.page_bytes
        self.retired.settle()
        over = self.quota.num_over(owner, len(wanted), page_bytes)
        self.counters.quota_skipped_pages += over
        return wanted[: len(wanted) - over], over

    def _evict_above_watermark(self) -> None:
        arena = self.allocator.arena_bytes
        if self.allocator.used_bytes > self.config.high_watermark * arena:
            self._evict(lambda: self.allocator.used_bytes - self.config.low_watermark * arena)

    def _evict(self, bytes_short, page_bytes: int = 0) -> None:
        """Evict committed entries nobody holds, oldest first, until ``bytes_short()`` is 0 (eviction.victims: which).
        A round picks what covers the shortfall (skipping pages a direct hold named at the start: they would stay
        allocated), takes it out of view and settles (one barrier and scan); a page held after the pick stays
        allocated, so another round may follow, at most MAX_EVICTION_ROUNDS: a reserve gets fewer pages rather
        than wait."""
        held_gens = self.retired.held_gens() if bytes_short() > 0 else set()
        for _round in range(MAX_EVICTION_ROUNDS):
            short = bytes_short()
            if short <= 0:
                return
            chosen, covered = [], 0
            groups = victims(
                self._lru.values(),
                self._leases.values(),
                self._reservations.values(),
                self.allocator.extent_bytes,
                page_bytes,
                held_gens,
            )
            for group in groups:  # picked first, removed after: the walk reads the LRU order as it is
                chosen += group
                covered += sum(entry.page_bytes for entry in group)
                if covered >= short:
                    break
            if not chosen:
                return
            for entry in chosen:
                self._remove_committed(entry)
                self.counters.evictions += 1
                self.counters.evicted_bytes += entry.page_bytes
            self.retired.settle()

    def _check_keys(self, keys: list[bytes]) -> None:
        if len(keys) > self.config.max_keys:
            raise PoolError("too_many_keys", f"{len(keys)} keys in one message; the limit is {self.config.max_keys}")
        for key in keys:
            if len(key) != KEY_BYTES:
                raise PoolError("bad_key", f"keys must be {KEY_BYTES} bytes, got one of {len(key)}")

    def check_integrity(self) -> None:
        """Raise AssertionError if the index and the allocator disagree (the whole pass at once)."""
        for _ in integrity_items(self):
            pass
