"""The engine's KV in the pool: a leased run of pages loaded into the sequence KV, computed chunks stored.

Two places move pages, whatever engine state they hold: ``load_prefix`` (lease the longest
run the pool holds and copy it into ``kv``; ``finish_load`` waits for it and releases the
lease) and ``store`` (reserve pages for chunks of ``kv``, copy them out after their producer,
commit). The pool is an accelerator, never a dependency: every call goes over the one
``kvshare.pool.link.PoolLink`` (timeouts, reconnects with backoff, holds a copy may still
touch, the watcher thread) and its ``guarded``: when the pool is down or refuses, the request
goes cold and the event is counted. A page whose checksum does not match is dropped from the
pool and recomputed; a reserve without room stores less.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import torch

from kvshare.engine import timeline
from kvshare.engine.stats import EngineStats
from kvshare.layout import KVLayout
from kvshare.pool.checksum import is_valid
from kvshare.pool.client import ChecksumMismatch, PoolClient, PoolRequestError
from kvshare.pool.link import POOL_DOWN_ERRORS, PoolLink, guarded
from kvshare.pool.protocol import FORMAT_VERSION, PageHeader
from kvshare.transfer import ChunkChecksumMismatch, TransferConfig, make_transfer

log = logging.getLogger(__name__)


@dataclass
class PoolLoad:
    """Chunks leased and loaded (or being loaded) for one request."""

    num_chunks: int = 0
    handle: Any = None  # LoadHandle
    lease_id: int = 0
    first_chunk: int = 0
    keys: list[bytes] = field(default_factory=list)  # of the pages being loaded (to drop those found bad)
    pages: list[PageHeader] = field(default_factory=list)
    cold_since: float | None = None  # perf_counter at the lookup of a prefill that reuses nothing: it gets timed
    cold_seconds: float | None = None  # that prefill's time (set by finish_load), reported with the prompt's store

    def before_layer(self, layer: int) -> None:
        if self.handle is not None:
            self.handle.wait_layer(layer)


class PoolKV:
    """The engine's loads from and stores to the pool, over one PoolLink; ``stats`` counts what they did."""

    def __init__(
        self,
        socket_path: str,
        layout: KVLayout,
        device: torch.device,
        stats: EngineStats,
        verify_checksums: bool = False,
        transfer_config: TransferConfig = TransferConfig(),
        retry_s: float = 0.5,
        retry_max_s: float = 30.0,
        name: str = "engine",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.layout = layout
        self.device = device
        self.stats = stats
        self.transfer_config = transfer_config
        self.link = PoolLink(
            socket_path, name, retry_s=retry_s, retry_max_s=retry_max_s, verify_checksums=verify_checksums, clock=clock
        )
        self.link.on_connect(self._use_client)
        self.link.on_drop(self._close_transfer)
        self.link.on_failure(self._count_unavailable)
        self.transfer = None  # over the arena of the link's client, set up at each connect
        stats.is_pool_configured = True

    @property
    def is_connected(self) -> bool:
        return self.link.is_connected

    def start(self, idle_lock: threading.Lock | None = None, watch_interval_s: float = 0.5) -> None:
        """Connect now (rather than in the first request) and watch the link until close().

        ``idle_lock``: held by whoever runs requests (the engine's); free means no request uses the client.
        """
        self.link.client()
        self.link.watch(idle_lock, watch_interval_s)

    def close(self) -> None:
        self.link.close()  # the transfer waited for its copies: the holds end

    def inject_producer_delay(self) -> None:
        """Validation: a GPU sleep on the compute stream before it writes KV that will be stored."""
        if self.transfer is not None:
            self.transfer.inject_producer_delay(None)

    def _use_client(self, client: PoolClient) -> None:
        """The link connected: the transfer over its arena."""
        self.transfer = make_transfer(self.layout, client, self.device, self.transfer_config)
        self.stats.pool_connects += 1

    def _close_transfer(self) -> None:
        """The link gives a client up: the transfer waits for its copies and closes before the arena goes."""
        transfer, self.transfer = self.transfer, None
        if transfer is not None:
            transfer.sync()
            transfer.close()

    def _count_unavailable(self, exc: BaseException) -> None:
        self.stats.pool_unavailable += 1  # a call found the pool down: its request goes without it

    # -- load ------------------------------------------------------------------------

    def load_prefix(self, kv: torch.Tensor, keys: list[bytes], first_chunk: int) -> PoolLoad:
        """Lease the longest run of ``keys`` the pool holds and load it as chunks first_chunk, ..."""
        started = time.perf_counter()
        if not keys:
            return PoolLoad()
        client = self.link.client()
        if client is None:
            self.stats.pool_unavailable += 1
            return PoolLoad()
        lease_and_load = lambda: self._lease_and_load(client, kv, keys, first_chunk, started)  # noqa: E731
        return guarded(self.link, self.stats, "a lookup", lease_and_load, PoolLoad())

    def _lease_and_load(
        self, client: PoolClient, kv: torch.Tensor, keys: list[bytes], first_chunk: int, started: float
    ) -> PoolLoad:
        lease = client.lookup(keys, self.layout.page_bytes)
        timeline.note("lookup_and_lease")  # the request's timeline, when it asked for one
        self.stats.pool_lookups += 1
        self.stats.pool_hit_chunks += lease.num_pages
        self.stats.pool_miss_chunks += len(keys) - lease.num_pages
        if not lease.pages:
            return PoolLoad(cold_since=started if first_chunk == 0 else None)
        load = PoolLoad(lease_id=lease.lease_id, first_chunk=first_chunk)
        try:
            try:
                load.handle = self.transfer.load(kv, first_chunk, lease.pages)
                load.pages = list(lease.pages)
            except ChecksumMismatch as exc:  # a transfer that checks before it copies (CPU)
                first_bad = self._drop_bad_pages(client, keys, lease.pages)
                if first_bad is None:  # the transfer saw something we cannot reproduce: use none of it
                    log.error("checksum mismatch not reproducible (%s); recomputing the whole run", exc)
                load.pages = lease.pages[: first_bad or 0]
                if load.pages:
                    load.handle = self.transfer.load(kv, first_chunk, load.pages)
            load.num_chunks = len(load.pages)
            load.keys = keys[: load.num_chunks]
        except BaseException:
            self.finish_load(load)  # releases the lease
            raise
        return load

    def _drop_bad_pages(self, client: PoolClient, keys: list[bytes], pages: list[PageHeader]) -> int | None:
        """Drop every leased page that fails verification on the host; the index of the first, None if none fails."""
        bad = [i for i, page in enumerate(pages) if not self._page_is_good(client, page)]
        if not bad:
            return None
        log.error(
            "checksum mismatch on %d pooled chunk(s); dropping them and recomputing from chunk %d", len(bad), bad[0]
        )
        self.stats.checksum_failures += len(bad)
        self.stats.dropped_chunks += client.drop([keys[i] for i in bad])
        return bad[0]

    def _page_is_good(self, client: PoolClient, page: PageHeader) -> bool:
        if page.page_bytes != self.layout.page_bytes or page.format_version != FORMAT_VERSION:
            return False
        return is_valid(client.page(page.offset, page.page_bytes), page)

    def finish_load(self, load: PoolLoad) -> int:
        """Wait for the whole load and its checks, then release its lease (fire and forget); time a cold prefill
        (``load.cold_seconds``).

        Returns the chunks of the load that may be used: all of them, or those before the first page that
        failed a check run beside the copies (CUDA), which the caller computes again.
        """
        if load.cold_since is not None:  # called after the prefill's forward: its kernels end before the clock stops
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            load.cold_seconds, load.cold_since = time.perf_counter() - load.cold_since, None
        if load.handle is not None:
            load.handle.wait_all()
            self.stats.pool_bytes_loaded += load.handle.num_bytes
            self.stats.pool_load_seconds += getattr(load.handle, "seconds", 0.0) or 0.0
            try:
                load.handle.verify()
            except ChunkChecksumMismatch as exc:  # the lease still holds the pages: find and drop the bad ones
                load.num_chunks = self._settle_failed_check(load, exc)
            load.handle = None
        client = self.link.current
        if load.lease_id and client is not None:
            client.release([load.lease_id])
        load.lease_id = 0
        return load.num_chunks

    def _settle_failed_check(self, load: PoolLoad, exc: ChunkChecksumMismatch) -> int:
        """The chunks before the first bad page; every page that fails on the host too is dropped from the pool."""
        first_bad = min(load.num_chunks, exc.chunk_index - load.first_chunk)
        client = self.link.current
        if client is None:  # given up meanwhile: the bad pages stay until a reader finds them again
            return first_bad
        drop_bad = lambda: self._drop_bad_pages(client, load.keys, load.pages)  # noqa: E731
        first_bad_in_pool = guarded(self.link, self.stats, "a drop", drop_bad, first_bad)
        if first_bad_in_pool is None:  # bad bytes in the copy, not in the page: counted, the page stays
            log.error("a pooled chunk failed its check in the copy (%s), not in the pool; recomputing from it", exc)
            self.stats.checksum_failures += 1
            return first_bad
        return min(first_bad, first_bad_in_pool)

    def drop(self, keys: list[bytes]) -> int:
        """Remove committed chunks from the pool (an audit found them wrong); 0 when the pool is away."""
        client = self.link.client() if keys else None
        if client is None:
            return 0
        dropped = guarded(self.link, self.stats, "a drop", lambda: client.drop(keys), 0)
        self.stats.dropped_chunks += dropped
        return dropped

    # -- store -----------------------------------------------------------------------

    def store(
        self,
        kv: torch.Tensor,
        keys: list[bytes],
        namespace: bytes,
        producer_stream=None,
        token_ids=None,
        account: bytes = b"",
        cold_seconds: float | None = None,
    ) -> None:
        """Store chunks 0..len(keys)-1 of ``kv`` that the pool does not hold yet (commit after the copy).

        ``token_ids`` (the prompt's, from its first token) let the pool announce the pages in KV events: the
        engine passes them only where no tenant salts the keys (an indexer that rehashes them cannot salt).
        ``account``: whose pool quota the pages count against (kvshare.pool.protocol.Reserve); empty: the namespace's.
        ``cold_seconds``: the prompt's prefill time when it reused nothing (PoolLoad.cold_seconds), reported so the
        pool weighs recomputing against its remote store.
        """
        client = self.link.client() if keys else None
        if client is None:
            return
        guarded(
            self.link,
            self.stats,
            "a store",
            lambda: self._store_run(
                client, kv, keys, producer_stream, namespace, token_ids=token_ids, account=account, cold=cold_seconds
            ),
        )

    def _store_run(
        self,
        client: PoolClient,
        kv: torch.Tensor,
        keys: list[bytes],
        producer_stream,
        namespace: bytes,
        *,
        token_ids,
        account: bytes,
        cold: float | None,
    ) -> None:
        """Reserve, copy out, commit; then report a cold prefill's time (``cold``)."""
        start = time.perf_counter()
        reservation = client.reserve(
            namespace,
            keys,
            self.layout.page_bytes,
            first_depth=0,
            token_ids=None if token_ids is None else token_ids[: len(keys) * self.layout.chunk_tokens],
            account=account,
        )
        self.stats.pool_skipped_stores += reservation.num_no_room
        if not reservation.grants:
            return
        try:
            checksums: list[int] = []
            for first_chunk, offsets in _consecutive_runs(reservation.grants):
                checksums += self.transfer.store(kv, first_chunk, offsets, producer_stream)
        except BaseException:
            self.transfer.sync()  # copies queued before the failure end before their pages are given back
            with suppress(PoolRequestError, *POOL_DOWN_ERRORS):
                client.abort(reservation.reservation_id)
            raise
        client.commit(reservation.reservation_id, checksums, self.transfer.checksum_kind)
        self.stats.pool_stored_chunks += len(reservation.grants)
        self.stats.pool_bytes_stored += len(reservation.grants) * self.layout.page_bytes
        self.stats.pool_store_seconds += time.perf_counter() - start
        if cold is not None:  # the pool weighs recomputing against its remote store
            with suppress(PoolRequestError):  # a pool without the message: nothing to weigh
                client.report_prefill(namespace, self.layout.page_bytes, len(keys), cold)


def _consecutive_runs(grants: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """[(chunk index, page offset)] in chunk order -> [(first chunk, [offsets])] of consecutive chunks."""
    runs: list[tuple[int, list[int]]] = []
    for index, offset in grants:
        if runs and runs[-1][0] + len(runs[-1][1]) == index:
            runs[-1][1].append(offset)
        else:
            runs.append((index, [offset]))
    return runs
