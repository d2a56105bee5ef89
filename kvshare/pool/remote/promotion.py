"""Promotion: a lookup the arena answers in part goes on to the remote store, batch by batch.

Per promoting lookup (a job), on the loop thread, with each arrow a hand-off to
or from a reader thread::

    start --> fetch batch k --> (verified pages) --> reserve as the promoter --> copy + re-checksum
                ^                                                                     |
                +---- next batch, while batch k came back whole ----      commit <----+
    when no fetch or copy is left: answer the waiting lookups from the index

Up to ``num_readers`` batches of a job are fetched at once (round trips overlap);
their results are applied strictly in chain order. A chunk the store lacks or
that fails a check ends the chain: pages before it are placed, pages after it
(including batches already under way) are dropped. Two lookups missing the
same chunk share one job.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvshare.pool.index import PoolError, PoolIndex
from kvshare.pool.remote import workers as W
from kvshare.pool.remote.breaker import CircuitBreaker
from kvshare.pool.remote.config import RemoteConfig
from kvshare.pool.remote.counters import RemoteCounters
from kvshare.pool.remote.format import RemotePage
from kvshare.pool.remote.store import RemoteStore

log = logging.getLogger("kvshare.pool.remote")


@dataclass(eq=False)
class _PromoteJob:
    keys: list[bytes]  # the chunks the arena lacked, in chain order
    page_bytes: int
    namespace: bytes | None  # of the chain (from the arena's last chunk before them, else the first page)
    waiters: list[Callable[[], None]]
    deadline: float
    batch_len: int
    num_asked: int = 0  # keys sent to the store so far
    num_found: int = 0  # chunks of the chain fetched whole and valid
    outstanding: int = 0  # fetch and copy tasks in flight
    num_batches: int = 0  # batches sent so far
    num_applied: int = 0  # batches applied, in order
    arrived: dict = field(default_factory=dict)  # batch number -> (length, result), waiting for its turn
    is_ended: bool = False  # no further batch is fetched (the chain broke, or the lookups were answered)
    is_broken: bool = False  # the chain broke: no further page is placed
    is_answered: bool = False


class Promotions:
    """The promoting lookups under way; every method runs on the loop thread."""

    def __init__(self, config: RemoteConfig, index: PoolIndex, promoter_id: int, store: RemoteStore,
                 breaker: CircuitBreaker, arena: np.ndarray, counters: RemoteCounters,
                 submit: Callable[[Callable, tuple, Callable], None], clock: Callable[[], float]) -> None:
        self.config = config
        self.index = index
        self.promoter_id = promoter_id
        self.store = store
        self.breaker = breaker
        self.counters = counters
        self._arena = arena
        self._submit = submit  # runs fn(*args) on a reader thread, then on_result(result) on the loop thread
        self._clock = clock
        self._is_closed = False
        self._jobs: set[_PromoteJob] = set()
        self._job_of_key: dict[bytes, _PromoteJob] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def start(self, keys: list[bytes], page_bytes: int, num_local: int, on_done: Callable[[], None]) -> bool:
        """Go on to the store for ``keys[num_local:]``; True: ``on_done()`` will be called once, later."""
        missing = keys[num_local:]
        if not missing or self._is_closed:
            return False
        job = self._job_of_key.get(missing[0])
        if job is not None:  # someone is already fetching this chunk: wait for that instead
            if job.is_answered:
                return False
            job.waiters.append(on_done)
            self.counters.joined_lookups += 1
            return True
        if self.index.entry(missing[0]) is not None:  # being written here (or a page of another size)
            return False
        if len(self._jobs) >= self.config.max_promotions:
            self.counters.promote_busy += 1
            return False
        if not self.breaker.allow():
            return False
        try:
            self.index.allocator.check_page_size(page_bytes)
        except ValueError:
            return False
        namespace = self.index.entry(keys[num_local - 1]).namespace if num_local else None
        batch_len = max(1, self.config.promote_batch_bytes // page_bytes)
        job = _PromoteJob(missing, page_bytes, namespace, [on_done], self._clock() + self.config.promote_timeout_s,
                          batch_len)
        self._jobs.add(job)
        for key in missing:
            self._job_of_key.setdefault(key, job)
        self.counters.lookups += 1
        self._fetch_more(job)
        return True

    def tick(self, now: float) -> None:
        """Answer promoting lookups past their deadline with what has arrived; stop fetching for them."""
        for job in list(self._jobs):
            if not job.is_answered and now >= job.deadline:
                self.counters.promote_timeouts += len(job.waiters)
                job.is_ended = True
                self._answer(job)

    def close(self) -> None:
        self._is_closed = True
        for job in self._jobs:
            job.waiters.clear()

    def _fetch_more(self, job: _PromoteJob) -> None:
        # batches held in memory (being fetched, waiting for their turn, being copied): at most num_readers
        while (not job.is_ended and job.num_asked < len(job.keys)
               and job.outstanding + len(job.arrived) < self.config.num_readers):
            batch = job.keys[job.num_asked : job.num_asked + job.batch_len]
            job.num_asked += len(batch)
            job.outstanding += 1
            args = (self.store, self.breaker, self.config, batch, job.page_bytes, job.namespace)
            on_fetched = functools.partial(self._on_fetched, job, job.num_batches, len(batch))
            job.num_batches += 1
            self._submit(W.fetch_pages, args, on_fetched)

    def _on_fetched(self, job: _PromoteJob, batch_no: int, batch_len: int,
                    result: W.FetchResult | BaseException) -> None:
        job.outstanding -= 1
        job.arrived[batch_no] = (batch_len, result)
        while job.num_applied in job.arrived:
            self._apply(job, *job.arrived.pop(job.num_applied))
            job.num_applied += 1
        self._fetch_more(job)
        self._maybe_finish(job)

    def _apply(self, job: _PromoteJob, batch_len: int, result: W.FetchResult | BaseException) -> None:
        """Count a batch's result and, while the chain is unbroken, place its pages."""
        if isinstance(result, BaseException):
            log.error("remote fetch failed: %r", result)
            self._break(job)
            return
        self._count_fetch(result)
        if job.is_broken or self._is_closed:
            return  # fetched ahead of a chunk that broke the chain: not part of it
        pages = result.pages
        if job.namespace is not None:  # a batch fetched before the chain's namespace was known
            same = [p.meta.namespace == job.namespace for p in pages]
            if not all(same):
                pages = pages[: same.index(False)]
                self._count_fetch(W.FetchResult([], None, discarded=[("fingerprint", "chunk of another namespace")]))
                self._break(job)
        job.num_found += len(pages)
        if pages:
            job.namespace = pages[0].meta.namespace
            self._place(job, pages)
        if result.end is not None or len(pages) < batch_len:
            self._break(job)

    @staticmethod
    def _break(job: _PromoteJob) -> None:
        job.is_broken = job.is_ended = True

    def _count_fetch(self, result: W.FetchResult) -> None:
        self.counters.errors += result.num_errors
        self.counters.deleted_values += result.num_deleted
        for reason, detail in result.discarded:
            name = f"discarded_{reason}"
            setattr(self.counters, name, getattr(self.counters, name) + 1)
            log.warning("discarded a remote page (%s): %s", reason, detail)

    def _place(self, job: _PromoteJob, pages: list[RemotePage]) -> None:
        """Reserve arena pages (as the promoter) for fetched pages and have a thread copy them in."""
        keys = [p.meta.key for p in pages]
        try:
            reserved = self.index.reserve(self.promoter_id, job.namespace, keys, job.page_bytes,
                                          pages[0].meta.depth, self._clock())
        except PoolError as exc:
            log.error("remote promotion: reserve refused: %s", exc)
            self._break(job)
            return
        if reserved.num_no_room:
            self.counters.promote_no_room += reserved.num_no_room
            self._break(job)
        if not reserved.grants:
            return
        placements = [(pages[i], entry.offset) for i, entry in reserved.grants]
        job.outstanding += 1
        on_copied = functools.partial(self._on_copied, job, reserved.reservation_id, placements)
        self._submit(W.copy_pages, (self._arena, placements), on_copied)

    def _on_copied(self, job: _PromoteJob, reservation_id: int, placements: list[tuple[RemotePage, int]],
                   result: list[int] | BaseException) -> None:
        job.outstanding -= 1
        expected = [page.meta.checksum for page, _ in placements]
        if isinstance(result, BaseException) or result != expected:
            bad = len(placements) if isinstance(result, BaseException) else sum(a != b for a, b in zip(result, expected))
            log.error("remote promotion: %d page(s) differ from their checksum after the copy: %r", bad, result)
            self.index.abort(self.promoter_id, reservation_id)
            self.counters.discarded_checksum += bad
            self._break(job)
        else:
            self.index.commit(self.promoter_id, reservation_id, expected)
            self.counters.promoted_pages += len(placements)
            self.counters.promoted_bytes += len(placements) * job.page_bytes
        self._fetch_more(job)  # a batch's memory is free again
        self._maybe_finish(job)

    def _maybe_finish(self, job: _PromoteJob) -> None:
        if job.outstanding or not (job.is_ended or job.num_asked >= len(job.keys)):
            return
        self._jobs.discard(job)
        for key in job.keys:
            if self._job_of_key.get(key) is job:
                del self._job_of_key[key]
        self.counters.hit_chunks += job.num_found
        self.counters.miss_chunks += len(job.keys) - job.num_found
        self._answer(job)

    def _answer(self, job: _PromoteJob) -> None:
        job.is_answered = True
        waiters, job.waiters = job.waiters, []
        for on_done in waiters:
            try:
                on_done()
            except Exception:
                log.exception("remote tier: answering a deferred lookup failed")
