"""A hybrid model's resume through the pool: KV pages and the state checkpoint at their end, as one lease.

A hybrid (Gated DeltaNet layers between attention layers) resumes a prefix of j chunks only with the KV of chunks
1..j and the GDN state after chunk j (kvshare.engine.hybrid_prefill). The pool holds both, each a page of its own
under its own key (kvshare.keys.state_key), through the same lookup, lease, checksum and eviction as every page::

    lookup   keys after the replica's own chunks, and the checkpoints it would resume from, deepest first
             -> the run of KV pages the pool holds and the deepest checkpoint that run reaches, leased together
    load     the state first (the first layer is a GDN layer: it reads the state before any KV), then the KV pages
             up to the chosen checkpoint, never beyond it
    finish   the state's and the pages' checks; a bad one is dropped from the pool and counted, and the prefill
             resumes from a shallower state
    store    after the prompt's KV: its checkpoints whose chunks 1..j the pool holds (reserve, copy, commit)

Every call goes over PoolKV's link (its timeouts, reconnects, holds) and its transfer (kvshare.transfer.state).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvshare.engine import timeline
from kvshare.engine.pool_kv import PoolKV, PoolLoad
from kvshare.keys import state_key
from kvshare.pool import protocol as P
from kvshare.pool.checksum import is_valid
from kvshare.pool.client import PoolClient
from kvshare.pool.link import guarded
from kvshare.transfer import StateChecksumMismatch, StateLoad

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolHit:
    """What one lookup leased: the run of KV pages after the replica's own chunks, and the checkpoint found
    (``state.index``: its place in the candidates asked for)."""

    lease_id: int = 0
    pages: tuple[P.PageHeader, ...] = ()
    state: P.StateHit | None = None


@dataclass
class StatefulLoad(PoolLoad):
    """A load of KV pages and, where the state comes from the pool, its checkpoint."""

    state: StateLoad | None = None
    state_key: bytes = b""
    state_page: P.PageHeader | None = None
    is_state_good: bool = True
    num_wanted: int = 0  # KV chunks the resume needs from the pool


class PoolStates:
    """A hybrid engine's lookups, loads and checkpoint stores, over one PoolKV (its link, transfer and stats)."""

    def __init__(self, pool: PoolKV, state_bytes: int) -> None:
        self.pool, self.state_bytes, self.stats = pool, state_bytes, pool.stats

    def lookup(self, keys: list[bytes], candidates: list[tuple[bytes, int]]) -> PoolHit:
        """Lease the longest run of ``keys`` and the first checkpoint of ``candidates`` ((state key, KV keys it
        needs), deepest first) that the run reaches; an empty hit when the pool is away or holds neither."""
        client = self.pool.link.client() if keys or candidates else None
        if client is None:
            return PoolHit()
        lookup = lambda: self._lookup(client, keys, candidates)  # noqa: E731
        return guarded(self.pool.link, self.stats, "a lookup", lookup, PoolHit())

    def _lookup(self, client: PoolClient, keys: list[bytes], candidates: list[tuple[bytes, int]]) -> PoolHit:
        states = [P.StateCandidate(key=key, num_kv=num_kv) for key, num_kv in candidates]
        grant = client.lookup(keys, self.pool.layout.page_bytes, states=states, state_page_bytes=self.state_bytes)
        timeline.note("lookup_and_lease")  # the request's timeline, when it asked for one
        self.stats.pool_lookups += 1
        self.stats.pool_hit_chunks += grant.num_pages
        self.stats.pool_miss_chunks += len(keys) - grant.num_pages
        return PoolHit(grant.lease_id, tuple(grant.pages), grant.state)

    def release(self, hit: PoolHit) -> None:
        """Give a hit's lease back unused (nothing was copied from its pages)."""
        client = self.pool.link.current
        if hit.lease_id and client is not None:
            client.release([hit.lease_id])

    def load(
        self,
        kv: torch.Tensor,
        hit: PoolHit,
        keys: list[bytes],
        first_chunk: int,
        num_chunks: int,
        state_into: torch.Tensor | None = None,
        state_at: int = 0,
    ) -> StatefulLoad:
        """Load the hit's checkpoint (the state after ``state_at`` chunks) into ``state_into`` (the live state's
        bytes; None: the state comes from elsewhere), then its first ``num_chunks`` KV pages as chunks first_chunk,
        ... of the prompt keyed ``keys``; the load owns the lease from here (``finish``). A page found bad before its
        copy (CPU) ends the load short."""
        load = StatefulLoad(lease_id=hit.lease_id, first_chunk=first_chunk, num_wanted=num_chunks)
        client = self.pool.link.current
        if client is None or self.pool.transfer is None:  # the link went away since the lookup
            load.is_state_good = state_into is None
            return load
        try:
            if state_into is not None:
                load.state_page, load.state_key = hit.state.page, state_key(keys[state_at - 1])
                try:
                    load.state = self.pool.transfer.load_state(hit.state.page, state_into)
                except StateChecksumMismatch as exc:
                    load.is_state_good = False
                    self._drop_bad_state(client, load, exc)
                    return load
            if num_chunks:
                run = keys[first_chunk : first_chunk + num_chunks]
                self.pool.load_pages(client, load, kv, run, list(hit.pages[:num_chunks]))
        except BaseException:
            self.finish(load)
            raise
        return load

    def wait_state(self, load: StatefulLoad, device: torch.device) -> None:
        """The compute stream waits until the loaded state has landed (before the first GDN layer)."""
        if load.state is not None:
            load.state.wait(device)

    def finish(self, load: StatefulLoad) -> bool:
        """Wait for the load and its checks, count it, release the lease; whether the resume it served stands: the
        state and every KV page it needed passed their checks (else the bad ones were dropped and counted)."""
        if load.state is not None:
            state, load.state = load.state, None
            try:
                state.verify()
                self.stats.pool_states_loaded += 1
                self.stats.pool_state_bytes_loaded += state.num_bytes
            except StateChecksumMismatch as exc:
                load.is_state_good = False
                client = self.pool.link.current
                if client is not None:
                    self._drop_bad_state(client, load, exc)
        verified = self.pool.finish_load(load)
        return load.is_state_good and verified >= load.num_wanted

    def _drop_bad_state(self, client: PoolClient, load: StatefulLoad, exc: StateChecksumMismatch) -> None:
        """A checkpoint failed its check: drop it from the pool where its page is bad there (not only the copy)."""
        self.stats.checksum_failures += 1
        page = load.state_page
        if page.format_version == P.FORMAT_VERSION and is_valid(client.page(page.offset, page.page_bytes), page):
            log.error("a pooled state checkpoint failed its check in the copy (%s), not in the pool", exc)
            return
        log.error("a pooled state checkpoint does not match its checksum (%s); dropped, resuming shallower", exc)
        drop = lambda: client.drop([load.state_key])  # noqa: E731
        self.stats.dropped_chunks += guarded(self.pool.link, self.stats, "a drop", drop, 0)

    def store(
        self,
        keys: list[bytes],
        checkpoints: list[tuple[int, torch.Tensor]],
        namespace: bytes,
        account: bytes,
        producer_stream=None,
    ) -> None:
        """Store ``checkpoints`` (after j chunks, bytes in the canonical layout) of the prompt keyed ``keys``; the
        caller passes only those whose chunks 1..j the pool holds. Reserve, copy after the producer, commit."""
        client = self.pool.link.client() if checkpoints else None
        if client is None:
            return
        store = lambda: self._store(client, keys, checkpoints, namespace, account, producer_stream)  # noqa: E731
        guarded(self.pool.link, self.stats, "a checkpoint store", store)

    def _store(self, client: PoolClient, keys, checkpoints, namespace: bytes, account: bytes, producer) -> None:
        state_keys = [state_key(keys[j - 1]) for j, _ in checkpoints]
        reservation = client.reserve(namespace, state_keys, self.state_bytes, account=account, holds_states=True)
        if not reservation.grants:
            return
        transfer = self.pool.transfer
        try:
            checksums = [transfer.store_state(checkpoints[i][1], offset, producer) for i, offset in reservation.grants]
        except BaseException:
            transfer.sync()  # copies queued before the failure end before their pages are given back
            guarded(self.pool.link, self.stats, "an abort", lambda: client.abort(reservation.reservation_id))
            raise
        client.commit(reservation.reservation_id, checksums, transfer.state_checksum_kind)
        self.stats.pool_states_stored += len(checksums)
        self.stats.pool_state_bytes_stored += len(checksums) * self.state_bytes
