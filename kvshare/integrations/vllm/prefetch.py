"""Copies ahead of a load, on the router's hint: which pages, under which lease, for how long (no torch).

A hint names a prompt the router has just placed on this replica (kvshare.router.hints). On the hint
listener's thread (kvshare.integrations.vllm.hint_listener) the ``Prefetcher`` hashes the prompt's chunk keys
in this replica's namespace, leases the run the pool holds through a pool connection of its own, and has the
device copy the pages ahead (``DeviceAhead``: on a GPU into its prefetch buffer, gpu_prefetch). When vLLM
schedules the request its load ``take``s the longest run of its own leased pages that a copy ahead holds under
the same key, pool and checksum, and reads those from the copy instead of the pool::

    hint   -> keys -> lookup + lease -> copy ahead (device) -> book     the lease goes once the copies ended
    load   -> take (key, pool, checksum of each page match)      -> the load verifies them as any page
           -> give_back once the load has ended                   -> the copy is dropped at the next tick
    tick   -> a copy ahead no load took within ``ttl_s`` is dropped (its lease went with its copies)

So a hint is trusted for speed only: a page that changed since (evicted, committed again with other bytes)
has another checksum and is loaded from the pool; a hint for keys the request does not have is never taken;
a hint whose request never comes costs its copy and its room until ``ttl_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvshare.integrations.vllm.counters import ConnectorCounters
from kvshare.integrations.vllm.pool_pages import release_lease
from kvshare.keys import Namespace, chunk_keys, namespace_digest
from kvshare.layout import KVLayout
from kvshare.pool.link import PoolLink, guarded
from kvshare.pool.protocol import PageHeader
from kvshare.router.hints import PrefetchHint

log = logging.getLogger("kvshare.integrations")
MAX_PREFETCHES = 64  # copies ahead held at once (their memory is the device's bound)


class AheadCopy(Protocol):
    """The device's copy of a run of pages (its first ``num_pages`` of those it was asked for)."""

    num_pages: int

    def is_done(self) -> bool:
        """Whether the copies from the pool's pages have ended (their lease may go)."""

    def release(self) -> None:
        """Give the copy's memory back (no load reads it any more)."""


class DeviceAhead(Protocol):
    def room(self) -> int:
        """Bytes of the largest free region."""

    def wanted(self, pages: Sequence[PageHeader]) -> int:
        """Bytes a copy ahead of ``pages`` would take whole (at most the whole buffer)."""

    def copy_ahead(self, client, pages: Sequence[PageHeader]) -> AheadCopy | None:
        """Start copying the leading pages (and layers) that fit from ``client``'s pool (a PoolClient whose lease
        holds them); None: none fits, or the device cannot copy from that pool now."""


class Regions:
    """First-fit allocation of byte ranges of ``[0, size)`` (pure)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []  # (start, length), by start
        self._taken: dict[int, int] = {}

    def largest(self) -> int:
        return max((length for _, length in self._free), default=0)

    def allocate(self, num_bytes: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= num_bytes > 0:
                self._free[i : i + 1] = [(start + num_bytes, length - num_bytes)] if length > num_bytes else []
                self._taken[start] = num_bytes
                return start
        return None

    def free(self, start: int) -> None:
        length = self._taken.pop(start)
        ranges = sorted([*self._free, (start, length)])
        merged: list[tuple[int, int]] = []
        for begin, size in ranges:
            if merged and merged[-1][0] + merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((begin, size))
        self._free = merged


@dataclass(eq=False)
class Prefetch:
    """One run of pages copied ahead, and its lease until its copies ended."""

    keys: tuple[bytes, ...]
    pages: tuple[PageHeader, ...]
    pool_id: bytes
    copy: AheadCopy
    lease_id: int
    created_at: float
    is_leased: bool = True
    num_users: int = 0  # loads that took it and have not ended
    was_taken: bool = False


@dataclass(frozen=True)
class PrefetchMatch:
    """Pages ``first .. first + num_pages - 1`` of ``prefetch`` are a load's first pages, in order."""

    prefetch: Prefetch
    first: int
    num_pages: int


@dataclass
class _Book:
    prefetches: list[Prefetch] = field(default_factory=list)  # oldest first
    by_key: dict[bytes, tuple[Prefetch, int]] = field(default_factory=dict)  # key -> (prefetch, page index)

    def add(self, prefetch: Prefetch) -> None:
        self.prefetches.append(prefetch)
        for index, key in enumerate(prefetch.keys):
            self.by_key.setdefault(key, (prefetch, index))

    def remove(self, prefetch: Prefetch) -> None:
        self.prefetches.remove(prefetch)
        for key in prefetch.keys:
            if self.by_key.get(key, (None,))[0] is prefetch:
                del self.by_key[key]


class Prefetcher:
    """Copies ahead on hints for one worker: ``on_hint``, ``on_refused`` and ``tick`` on the listener's thread,
    ``take`` and ``give_back`` on the hooks' thread. ``served_models``: the names under which vLLM serves the
    base model (a hint for another, a LoRA adapter's, is not acted on)."""

    def __init__(
        self,
        link: PoolLink,
        kv_layout: KVLayout,
        namespace: Namespace,
        served_models: Sequence[str],
        device: DeviceAhead,
        ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link, self.kv_layout, self.namespace = link, kv_layout, namespace
        self.served_models, self.device, self.ttl_s, self._clock = set(served_models), device, ttl_s, clock
        self._lock = threading.Lock()  # the book and the counters, between the two threads
        self._book = _Book()
        self._digests: dict[str, bytes] = {}  # cache_salt -> namespace digest (listener thread only)
        self._counters = ConnectorCounters()
        self._refusals_logged = 0

    # -- the listener's thread ---------------------------------------------------------------------

    def on_hint(self, hint: PrefetchHint) -> None:
        """Lease the run the pool holds for the hinted prompt and have the device copy it ahead."""
        with self._lock:
            self._counters.hints += 1
        keys = self._keys(hint)
        if not keys or hint.model not in self.served_models:
            return
        with self._lock:
            if keys[0] in self._book.by_key:
                return  # hinted already (the same prompt again): its copy ahead serves both
        client = self.link.client()
        if client is None:
            return
        lease = guarded(self.link, self._counters, "a prefetch lookup", lambda: client.lookup(keys, self.page_bytes))
        if lease is None or not lease.pages:
            return
        pages = list(lease.pages)
        pool_id = client.hello.pool_id
        copy = self._copy_ahead(client, pages)
        if copy is None:
            release_lease(self.link, lease.lease_id, pool_id)
            return
        n = copy.num_pages
        prefetch = Prefetch(tuple(keys[:n]), tuple(pages[:n]), pool_id, copy, lease.lease_id, self._clock())
        with self._lock:
            self._book.add(prefetch)
            self._counters.prefetched_pages += n

    @property
    def page_bytes(self) -> int:
        return self.kv_layout.page_bytes

    def _keys(self, hint: PrefetchHint) -> list[bytes]:
        """The chunk keys of the hinted prompt's full chunks, in this replica's namespace salted as the request."""
        digest = self._digests.get(hint.cache_salt)
        if digest is None:
            if len(self._digests) > 1024:
                self._digests.clear()
            salted = dataclasses.replace(self.namespace, tenant_salt=hint.cache_salt, lora_id="")
            digest = self._digests[hint.cache_salt] = namespace_digest(salted)
        C = self.kv_layout.chunk_tokens
        tokens = hint.tokens()
        return chunk_keys(digest, tokens[: len(tokens) // C * C], C)

    def _copy_ahead(self, client, pages: list[PageHeader]) -> AheadCopy | None:
        """The device's copy of the run, room made first: the oldest copies ahead no load holds whose copies have
        ended are dropped while the run would not fit whole (or the book is full); then what fits is copied."""
        wanted = self.device.wanted(pages)
        with self._lock:
            idle = [p for p in self._book.prefetches if not p.num_users and not p.is_leased]
            while idle and (self.device.room() < wanted or len(self._book.prefetches) >= MAX_PREFETCHES):
                self._drop(idle.pop(0))
            if len(self._book.prefetches) >= MAX_PREFETCHES:
                return None
        return self.device.copy_ahead(client, pages)

    def on_refused(self, why: str) -> None:
        """A frame that was not a hint this replica may act on (counted; the first few logged)."""
        with self._lock:
            self._counters.hints_refused += 1
            self._refusals_logged += 1
            is_logged = self._refusals_logged <= 3
        if is_logged:
            log.warning("kvshare: a prefetch hint was refused: %s", why)

    def tick(self) -> None:
        """Leases of copies that ended go; copies no load took within ``ttl_s`` are dropped, taken ones once
        their loads ended."""
        now = self._clock()
        with self._lock:
            ended = [p for p in self._book.prefetches if p.is_leased and p.copy.is_done()]
            for prefetch in ended:
                prefetch.is_leased = False
            for prefetch in list(self._book.prefetches):
                is_stale = not prefetch.was_taken and now - prefetch.created_at >= self.ttl_s
                if not prefetch.num_users and not prefetch.is_leased and (prefetch.was_taken or is_stale):
                    self._counters.prefetches_unused += int(is_stale)
                    self._drop(prefetch)
        for prefetch in ended:
            release_lease(self.link, prefetch.lease_id, prefetch.pool_id)

    def _drop(self, prefetch: Prefetch) -> None:
        self._book.remove(prefetch)
        prefetch.copy.release()

    # -- the hooks' thread ---------------------------------------------------------------------------

    def take(self, pool_id: bytes, keys: Sequence[bytes], pages: Sequence[PageHeader]) -> PrefetchMatch | None:
        """The copy ahead of a load's first pages (``keys``, ``pages``: the load's, in order), where one holds
        them under the same key, pool and checksum; held for the load until ``give_back``."""
        with self._lock:
            found = self._book.by_key.get(keys[0]) if keys else None
            if found is None or found[0].pool_id != pool_id:
                return None
            prefetch, first = found
            n = 0
            while n < len(keys) and first + n < len(prefetch.keys) and prefetch.keys[first + n] == keys[n]:
                held, wanted = prefetch.pages[first + n], pages[n]
                if (held.checksum, held.checksum_kind) != (wanted.checksum, wanted.checksum_kind):
                    break  # committed again since, with other bytes: from the pool
                n += 1
            if not n:
                return None
            prefetch.num_users += 1
            prefetch.was_taken = True
            self._counters.prefetch_hits += n
            return PrefetchMatch(prefetch, first, n)

    def give_back(self, match: PrefetchMatch) -> None:
        """The load that took ``match`` has ended: nothing reads its copy any more."""
        with self._lock:
            match.prefetch.num_users -= 1

    def take_counters(self) -> ConnectorCounters:
        with self._lock:
            return self._counters.take()

    def close(self) -> None:
        """Release the leases still held and close the pool connection: after the device's copies ended (the
        worker closes its pipeline, which waits for them, before this)."""
        with self._lock:
            prefetches, self._book = self._book.prefetches, _Book()
        for prefetch in prefetches:
            if prefetch.is_leased:
                release_lease(self.link, prefetch.lease_id, prefetch.pool_id)
        self.link.close()
