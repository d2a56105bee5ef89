"""The engine's side of the pool: lease and load a prefix, store computed chunks.

The pool is an accelerator, never a dependency: when it cannot be reached
(PoolUnavailable, a timeout) the request goes cold, the event is counted, and the
link (kvshare.pool.link: the one policy for timeouts, reconnects and holds)
reconnects later with exponential backoff, keeping the holds a copy may still touch. A page whose checksum does not
match is dropped from the pool and recomputed; a reserve without room stores less.

``start()`` also watches the link from a thread: while the pool is away it tries
again whenever the backoff allows (a warning each time), without waiting for a
request, and it notices a pool that closed the connection (a restarted pool) and
connects to the new one. A client may be in use by a request (reading the arena),
so the watcher drops one only while it holds the engine's request lock, taken
without waiting; otherwise the request's next use reconnects.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import torch

from kvshare.engine import timeline
from kvshare.engine.stats import EngineStats
from kvshare.layout import KVLayout
from kvshare.pool.checksum import is_valid
from kvshare.pool.client import ChecksumMismatch, PoolClient, PoolRequestError, PoolUnavailable
from kvshare.pool.link import PoolLink as Link
from kvshare.pool.protocol import FORMAT_VERSION, PageHeader
from kvshare.transfer import ChunkChecksumMismatch, TransferConfig, make_transfer

log = logging.getLogger(__name__)
_LOST = (PoolUnavailable, TimeoutError)


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

    def before_layer(self, layer: int) -> None:
        if self.handle is not None:
            self.handle.wait_layer(layer)


class PoolLink:
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
        self.socket_path = socket_path
        self.layout = layout
        self.device = device
        self.stats = stats
        self.verify_checksums = verify_checksums
        self.transfer_config = transfer_config
        self.name = name
        self.link = Link(
            socket_path, name, retry_s=retry_s, retry_max_s=retry_max_s, verify_checksums=verify_checksums, clock=clock
        )
        self.link.on_connect(self._use_client)
        self.link.on_drop(self._close_transfer)
        self._lock = threading.Lock()  # connect and drop: the request thread and the watcher
        self._closed = threading.Event()
        self._is_stale = False  # the watcher saw the pool close the connection; the next use reconnects
        self._idle_lock: threading.Lock | None = None
        self.transfer = None
        self._cold_seconds: float | None = None  # the last cold prefill's time, reported with its store
        stats.is_pool_configured = True

    # -- connection ------------------------------------------------------------------

    @property
    def client(self) -> PoolClient | None:
        return self.link.current

    def start(self, idle_lock: threading.Lock | None = None, watch_interval_s: float = 0.5) -> None:
        """Connect now (rather than in the first request) and watch the link until close().

        ``idle_lock``: held by whoever runs requests (the engine's); free means no request uses the client.
        """
        self._idle_lock = idle_lock
        self.connected()
        ref = weakref.ref(self)  # the watcher ends when the link is collected, too
        threading.Thread(
            target=_watch, args=(ref, self._closed, watch_interval_s), daemon=True, name=f"pool watch {self.name}"
        ).start()

    def connected(self) -> bool:
        """True when the pool is usable now; tries to (re)connect when the backoff allows. The request thread's call."""
        with self._lock:
            if self.client is not None and self.client.is_connected and not self._is_stale:
                return True
            self._drop_client()
            return self._connect_when_due()

    def _watch_once(self) -> None:
        with self._lock:
            if self.client is None:
                self._connect_when_due()
                return
            if not self._is_stale and self.client.is_peer_closed():
                self._is_stale = True
                self.stats.is_pool_connected = False
                log.warning("the pool at %s closed the connection; reconnecting", self.socket_path)
            if self._is_stale and self._idle_lock is not None and self._idle_lock.acquire(blocking=False):
                try:  # no request runs (nor can start): the client is ours to replace
                    self._drop_client()
                    self._connect_when_due()
                finally:
                    self._idle_lock.release()

    def _connect_when_due(self) -> bool:
        if self._closed.is_set():
            return False
        return self.link.client() is not None  # a transfer that cannot be set up raises (tried again later)

    def _use_client(self, client: PoolClient) -> None:
        """The link connected: the transfer over its arena."""
        self.transfer = make_transfer(self.layout, client, self.device, self.transfer_config)
        self.stats.pool_connects += 1
        self.stats.is_pool_connected = True

    def _close_transfer(self) -> None:
        """The link gives a client up: the transfer waits for its copies and closes before the arena goes."""
        transfer, self.transfer = self.transfer, None
        if transfer is not None:
            transfer.sync()
            transfer.close()

    def _lost(self, exc: BaseException) -> None:
        with self._lock:
            self.stats.pool_unavailable += 1
            self.link.failed(exc)  # the holds stay: a copy of this process may still touch their pages
            self._is_stale = False
            self.stats.is_pool_connected = False

    def _drop_client(self) -> None:
        """Give the client and its transfer up, keeping the holds (holding self._lock)."""
        self.link.drop()
        self._is_stale = False
        self.stats.is_pool_connected = False

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self.link.close()  # the transfer waited for its copies: the holds end
            self.stats.is_pool_connected = False

    def inject_producer_delay(self) -> None:
        """Validation: a GPU sleep on the compute stream before it writes KV that will be stored."""
        if self.transfer is not None:
            self.transfer.inject_producer_delay(None)

    # -- load ------------------------------------------------------------------------

    def load_prefix(self, kv: torch.Tensor, keys: list[bytes], first_chunk: int) -> PoolLoad:
        """Lease the longest run of ``keys`` the pool holds and load it as chunks first_chunk, ..."""
        started, self._cold_seconds = time.perf_counter(), None
        if not keys:
            return PoolLoad()
        if not self.connected():
            self.stats.pool_unavailable += 1
            return PoolLoad()
        try:
            lease = self.client.lookup(keys, self.layout.page_bytes)
            timeline.note("lookup_and_lease")  # the request's timeline, when it asked for one
            self.stats.pool_lookups += 1
            self.stats.pool_hit_chunks += lease.num_pages
            self.stats.pool_miss_chunks += len(keys) - lease.num_pages
            if not lease.pages:
                return PoolLoad(cold_since=started if first_chunk == 0 else None)
            load = PoolLoad(0, None, lease.lease_id, first_chunk)
            try:
                try:
                    load.handle = self.transfer.load(kv, first_chunk, lease.pages)
                    load.pages = list(lease.pages)
                except ChecksumMismatch as exc:  # a transfer that checks before it copies (CPU)
                    first_bad = self._drop_bad_pages(keys, lease.pages)
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
        except _LOST as exc:
            self._lost(exc)
            return PoolLoad()
        except PoolRequestError as exc:
            self.stats.pool_errors += 1
            log.warning("the pool refused a lookup: %s", exc)
            return PoolLoad()

    def _drop_bad_pages(self, keys: list[bytes], pages: list[PageHeader]) -> int | None:
        """Drop every leased page that fails verification on the host; the index of the first, None if none fails."""
        bad = [i for i, page in enumerate(pages) if not self._page_is_good(page)]
        if not bad:
            return None
        log.error(
            "checksum mismatch on %d pooled chunk(s); dropping them and recomputing from chunk %d", len(bad), bad[0]
        )
        self.stats.checksum_failures += len(bad)
        self.stats.dropped_chunks += self.client.drop([keys[i] for i in bad])
        return bad[0]

    def _page_is_good(self, page: PageHeader) -> bool:
        if page.page_bytes != self.layout.page_bytes or page.format_version != FORMAT_VERSION:
            return False
        return is_valid(self.client.page(page.offset, page.page_bytes), page)

    def finish_load(self, load: PoolLoad) -> int:
        """Wait for the whole load and its checks, then release its lease (fire and forget); time a cold prefill.

        Returns the chunks of the load that may be used: all of them, or those before the first page that
        failed a check run beside the copies (CUDA), which the caller computes again.
        """
        if load.cold_since is not None:  # called after the prefill's forward: its kernels end before the clock stops
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._cold_seconds, load.cold_since = time.perf_counter() - load.cold_since, None
        if load.handle is not None:
            load.handle.wait_all()
            self.stats.pool_bytes_loaded += load.handle.num_bytes
            self.stats.pool_load_seconds += getattr(load.handle, "seconds", 0.0) or 0.0
            try:
                load.handle.verify()
            except ChunkChecksumMismatch as exc:  # the lease still holds the pages: find and drop the bad ones
                load.num_chunks = self._settle_failed_check(load, exc)
            load.handle = None
        if load.lease_id and self.client is not None:
            self.client.release([load.lease_id])
        load.lease_id = 0
        return load.num_chunks

    def _settle_failed_check(self, load: PoolLoad, exc: ChunkChecksumMismatch) -> int:
        """The chunks before the first bad page; every page that fails on the host too is dropped from the pool."""
        first_bad = min(load.num_chunks, exc.chunk_index - load.first_chunk)
        try:
            first_bad_in_pool = self._drop_bad_pages(load.keys, load.pages)
        except _LOST as lost:
            self._lost(lost)
            return first_bad
        except PoolRequestError as refused:
            self.stats.pool_errors += 1
            log.warning("the pool refused a drop: %s", refused)
            return first_bad
        if first_bad_in_pool is None:  # bad bytes in the copy, not in the page: counted, the page stays
            log.error("a pooled chunk failed its check in the copy (%s), not in the pool; recomputing from it", exc)
            self.stats.checksum_failures += 1
            return first_bad
        return min(first_bad, first_bad_in_pool)

    def drop(self, keys: list[bytes]) -> int:
        """Remove committed chunks from the pool (an audit found them wrong); 0 when the pool is away."""
        if not keys or not self.connected():
            return 0
        try:
            dropped = self.client.drop(keys)
        except _LOST as exc:
            self._lost(exc)
            return 0
        except PoolRequestError as exc:
            self.stats.pool_errors += 1
            log.warning("the pool refused a drop: %s", exc)
            return 0
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
    ) -> None:
        """Store chunks 0..len(keys)-1 of ``kv`` that the pool does not hold yet (commit after the copy).

        ``token_ids`` (the prompt's, from its first token) let the pool announce the pages in KV events: the
        engine passes them only where no tenant salts the keys (an indexer that rehashes them cannot salt).
        ``account``: whose pool quota the pages count against (kvshare.pool.protocol.Reserve); empty: the namespace's.
        """
        if not keys or not self.connected():
            return
        start = time.perf_counter()
        try:
            reservation = self.client.reserve(
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
                with suppress(*_LOST, PoolRequestError):
                    self.client.abort(reservation.reservation_id)
                raise
            self.client.commit(reservation.reservation_id, checksums, self.transfer.checksum_kind)
            self.stats.pool_stored_chunks += len(reservation.grants)
            self.stats.pool_bytes_stored += len(reservation.grants) * self.layout.page_bytes
            self.stats.pool_store_seconds += time.perf_counter() - start
            if self._cold_seconds is not None:  # the pool weighs recomputing against its remote store
                seconds, self._cold_seconds = self._cold_seconds, None
                with suppress(PoolRequestError):  # a pool without the message: nothing to weigh
                    self.client.report_prefill(namespace, self.layout.page_bytes, len(keys), seconds)
        except _LOST as exc:
            self._lost(exc)
        except PoolRequestError as exc:
            self.stats.pool_errors += 1
            log.warning("the pool refused a store: %s", exc)


def _watch(ref: weakref.ref[PoolLink], closed: threading.Event, interval_s: float) -> None:
    """The watcher thread: holds the link only while it looks at it."""
    while not closed.wait(interval_s):
        link = ref()
        if link is None:
            return
        try:
            link._watch_once()
        except Exception:  # a transfer that cannot be set up: the request path will raise it
            log.exception("watching the pool link failed")
        del link


def _consecutive_runs(grants: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """[(chunk index, page offset)] in chunk order -> [(first chunk, [offsets])] of consecutive chunks."""
    runs: list[tuple[int, list[int]]] = []
    for index, offset in grants:
        if runs and runs[-1][0] + len(runs[-1][1]) == index:
            runs[-1][1].append(offset)
        else:
            runs.append((index, [offset]))
    return runs
