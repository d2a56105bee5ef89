"""The pool's remote tier: pools on several hosts share pages through a Redis/Valkey store.

Two flows, both off the daemon's loop thread for every byte and every round trip::

    write-behind   client commits --> loop pins the pages (a lease of the tier's own writer id)
                   --> writer thread: skip pages the store holds, else copy out + SET parts
                   --> loop releases the pin           (the local commit never waits)

    promotion      client looks up, the arena lacks chunk i --> loop defers the reply
                   --> reader thread: GET the parts of chunks i, i+1, ... (a batch), verify
                   --> loop reserves pages (the tier's promoter id) --> reader copies, re-checksums
                   --> loop commits; next batch ...; then the deferred lookup is answered from
                       the index, leasing the promoted pages like any others

Threads hand results back through a queue and a wake-up socket the loop's
selector watches, so the index keeps one thread and no locks. The loop's side
of the tier lives here (promotion jobs in promotion.py); the threads' side
in workers.py. The daemon reaches it only through ``hooks.RemoteHooks``.
"""

from __future__ import annotations

import functools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.entries import EntryState
from kvshare.pool.index import PoolError, PoolIndex
from kvshare.pool.remote import workers as W
from kvshare.pool.remote.breaker import CircuitBreaker
from kvshare.pool.remote.config import RemoteConfig
from kvshare.pool.remote.cost import PromotionCosts
from kvshare.pool.remote.counters import RemoteCounters
from kvshare.pool.remote.format import PageMeta
from kvshare.pool.remote.promotion import Promotions
from kvshare.pool.remote.store import RemoteStore

log = logging.getLogger("kvshare.pool.remote")


@dataclass(eq=False)
class _PendingWrite:
    """A write to the remote store in flight, under a lease on the pages it reads."""

    lease_id: int
    num_pages: int
    num_bytes: int


class RemoteTier:
    """The loop thread's side of the remote tier; every method runs on that thread."""

    def __init__(
        self,
        config: RemoteConfig,
        index: PoolIndex,
        arena,
        lease_ttl_s: float,
        writer_id: int,
        promoter_id: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.check_lease_ttl(lease_ttl_s)
        config.check_reservation_ttl(index.config.reservation_ttl_s)
        self.config = config
        self.index = index
        self.writer_id, self.promoter_id = writer_id, promoter_id
        self._arena = np.frombuffer(arena, dtype=np.uint8)
        # a pinned page is read no later than this long after its pin: the pin's lease cannot have expired
        self._read_window_s = lease_ttl_s - 2 * (config.timeout_s + config.promote_timeout_s)
        self._write_budget = min(config.write_queue_bytes, index.allocator.arena_bytes // 4)
        self._clock = clock
        self.store = RemoteStore(config.address, config.timeout_s, config.allow_hosts)
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_reset_s)
        self.counters = RemoteCounters()
        self._writers = ThreadPoolExecutor(config.num_writers, thread_name_prefix="kvshare-remote-write")
        self._readers = ThreadPoolExecutor(config.num_readers, thread_name_prefix="kvshare-remote-read")
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wakeup, self._wakeup_w = socket.socketpair()  # the loop's selector watches ``wakeup``
        self.wakeup.setblocking(False)
        self._wakeup_w.setblocking(False)
        self._closing = threading.Event()
        self._reservations: dict[int, tuple[int, list]] = {}  # client reservation id -> (client id, entries)
        self._pending_pages = 0  # pinned for write-behind
        self._pending_bytes = 0
        self.costs = PromotionCosts()
        self._promotions = Promotions(
            config,
            index,
            promoter_id,
            self.store,
            self.breaker,
            self._arena,
            self.counters,
            self.costs,
            functools.partial(self._submit, self._readers),
            clock,
        )
        log.info("remote tier: %s, prefix %r", config.address.display, config.prefix)
        self._submit(self._writers, W.probe, (self.store, self.breaker), self._on_probed)

    # -- hooks called by the daemon ---------------------------------------------------

    def on_reserve(self, client_id: int, reservation_id: int, entries: list) -> None:
        if reservation_id:
            self._reservations[reservation_id] = (client_id, entries)

    def on_abort(self, reservation_id: int) -> None:
        self._reservations.pop(reservation_id, None)

    def on_disconnect(self, client_id: int) -> None:
        for rid in [rid for rid, (cid, _) in self._reservations.items() if cid == client_id]:
            del self._reservations[rid]

    def on_commit(self, reservation_id: int) -> None:
        """A client's pages became visible: pin them and write them behind (or count why not)."""
        _, entries = self._reservations.pop(reservation_id, (0, []))
        # the remote format carries xxh3 checksums only: pages a GPU writer checksummed (WSUM32) stay local
        entries = [
            e
            for e in entries
            if e.state is EntryState.COMMITTED and not e.is_dropped and e.checksum_kind == ChecksumKind.XXH3
        ]
        if not entries or self._closing.is_set():
            return
        if not self.breaker.allow():
            self.counters.write_dropped_breaker += len(entries)
            return
        page_bytes = entries[0].page_bytes
        room = max(0, (self._write_budget - self._pending_bytes) // page_bytes)
        self.counters.write_dropped_full += max(0, len(entries) - room)
        entries = entries[:room]
        if not entries:
            return
        now = self._clock()
        pin = self.index.lookup(self.writer_id, [e.key for e in entries], page_bytes, now, is_counted=False)
        if not pin.entries:
            return
        pages = [
            W.PageToWrite(PageMeta(e.key, e.namespace, e.depth, e.page_bytes, e.checksum), e.offset)
            for e in pin.entries
        ]
        job = _PendingWrite(pin.lease_id, len(pages), len(pages) * page_bytes)
        self._pending_pages += job.num_pages
        self._pending_bytes += job.num_bytes
        args = (
            self.store,
            self.breaker,
            self.config,
            self._arena,
            pages,
            now + self._read_window_s,
            self._closing.is_set,
        )
        self._submit(self._writers, W.write_pages, args, functools.partial(self._on_written, job))

    def promote(self, keys: list[bytes], page_bytes: int, num_local: int, on_done: Callable[[], None]) -> bool:
        """Go on to the store for ``keys[num_local:]``; True: ``on_done()`` will be called once, later."""
        return self._promotions.start(keys, page_bytes, num_local, on_done)

    def promote_state(self, keys: list[bytes], page_bytes: int, on_done: Callable[[], None]) -> bool:
        """Fetch the first of ``keys`` (state checkpoints, deepest first) that the store holds; True: ``on_done()``
        will be called once, later. One round trip finds it, then it is promoted as a page of its own."""
        if not keys or self._closing.is_set() or not self.breaker.allow():
            return False
        if self._promotions.num_waiting >= self.config.max_promotions:
            self.counters.promote_busy += 1
            return False

        def found(index: int | None | BaseException) -> None:
            if isinstance(index, BaseException):
                log.error("remote tier: looking for a state checkpoint failed: %r", index)
            elif index is not None and self._promotions.start([keys[index]], page_bytes, 0, on_done, True):
                return
            on_done()  # none held, or its promotion did not start: the lookup is answered from the arena

        self._submit(self._readers, W.first_held, (self.store, self.breaker, self.config, list(keys)), found)
        return True

    def on_prefill(self, namespace: bytes, page_bytes: int, num_chunks: int, seconds: float) -> None:
        """A replica's cold prefill: what recomputing costs in that namespace (promotion weighs it)."""
        self.costs.report_prefill(namespace, page_bytes, num_chunks, seconds)

    def poll(self) -> None:
        """Apply every result the threads have handed back (the wake-up socket was readable)."""
        try:
            while self.wakeup.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                handler, result = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                handler(result)
            except Exception:  # a bug in one result must not stop the loop
                log.exception("remote tier: applying a result failed")

    def tick(self, now: float) -> None:
        self._promotions.tick(now)

    def reservations_in_copy(self) -> set[int]:
        return self._promotions.in_copy

    def stats(self) -> dict[str, int]:
        return {
            **self.counters.__dict__,
            **self.costs.stats(),
            "write_queue_pages": self._pending_pages,
            "write_queue_bytes": self._pending_bytes,
            "promotions": len(self._promotions),
            "breaker_state": self.breaker.state,
            "breaker_opens": self.breaker.num_opens,
        }

    def close(self) -> None:
        """Stop the threads (each finishes at most its current store operation) and the store client."""
        self._closing.set()
        self._promotions.close()
        self._writers.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self.store.close()
        self.wakeup.close()
        self._wakeup_w.close()

    def _on_probed(self, error: str | BaseException | None) -> None:
        if error is None:
            log.info("remote store %s answers", self.config.address.display)
        else:
            self.counters.errors += 1
            log.warning("remote store not reachable (yet): %s; serving from the arena meanwhile", error)

    # -- write-behind ---------------------------------------------------------------

    def _on_written(self, job: _PendingWrite, result: W.WriteResult | BaseException) -> None:
        self._pending_pages -= job.num_pages
        self._pending_bytes -= job.num_bytes
        try:
            self.index.release(self.writer_id, job.lease_id)
        except PoolError:
            pass  # the pin's lease expired (the write ran past the lease TTL and read nothing after it)
        if isinstance(result, BaseException):
            log.error("remote write-behind failed: %r", result)
            self.counters.write_failed += job.num_pages
            return
        c = self.counters
        c.written_pages += result.num_written
        c.written_bytes += result.num_bytes
        c.write_existing += result.num_existing
        c.write_failed += result.num_failed
        c.write_dropped_breaker += result.num_breaker
        c.write_expired += result.num_expired
        c.write_bad_pages += result.num_bad
        c.errors += result.num_errors
        if result.num_bad:
            log.error("%d committed page(s) no longer match their checksum; not written to the store", result.num_bad)

    # -- threads -> loop --------------------------------------------------------------

    def _submit(self, executor: ThreadPoolExecutor, fn, args: tuple, on_result: Callable) -> None:
        def task() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:  # a bug: the loop logs it and releases what the job holds
                result = exc
            self._inbox.put((on_result, result))
            try:
                self._wakeup_w.send(b"\0")
            except (BlockingIOError, OSError):
                pass  # a wake-up is pending already (or the tier closed)

        executor.submit(task)
