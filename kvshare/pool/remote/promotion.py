"""Promotion: a lookup the arena answers in part goes on to the remote store, batch by batch.

Per promoting lookup (a job), on the loop thread, each arrow a hand-off to or from a reader thread::

    start --(cost.plan: how many chunks arrive sooner than recomputed; 0: answered at once)
      |
      +-- values (chain not known yet) fetch as values --> verify --> reserve --> copy, re-checksum --> commit
      |        the first batch one page (a probe): its header names the chain's namespace and depth
      +-- direct (chain known)   reserve a batch's pages --> fetch into them, verify in place --> commit / abort
      ^                                                                                            |
      +---------------------------- next batch, while batch k came back whole ---------------------+
    when no fetch or copy is left: answer the waiting lookups from the index

A batch is reserved before it is fetched only when that cannot cost the arena
anything for a chain the store may lack: when the arena has free pages for it,
or once a page of the chain has come back whole (the probe; batches sent
while it is out go as values). Up to
``num_readers`` batches of a job are in flight at once (round trips overlap);
their results are applied strictly in chain order. A chunk the store lacks or
that fails a check ends the chain: pages before it are placed, pages after it
(including batches already under way) are dropped or aborted. Two lookups
missing the same chunk share one job.

Lifetimes follow the copies: a fetch into reserved pages receives nothing
after its job's deadline plus one store timeout (resp.RespConnection), and
while a thread may still write into a reservation's pages (a fetch or a copy
under way: ``in_copy``) the pool does not expire it; the loop aborts or
commits it once the thread's result is back.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np

from kvshare.pool.index import PoolError, PoolIndex
from kvshare.pool.remote import workers as W
from kvshare.pool.remote.breaker import CircuitBreaker
from kvshare.pool.remote.config import RemoteConfig
from kvshare.pool.remote.cost import PromotionCosts
from kvshare.pool.remote.counters import RemoteCounters
from kvshare.pool.remote.direct import LandedResult, fetch_into
from kvshare.pool.remote.format import RemotePage
from kvshare.pool.remote.jobs import Batch, PromotingLookup
from kvshare.pool.remote.store import RemoteStore

log = logging.getLogger("kvshare.pool.remote")
PROBE_PAGES = 1  # fetched as values, before the chain is known to be in the store


class Promotions:
    """The promoting lookups under way; every method runs on the loop thread."""

    def __init__(
        self,
        config: RemoteConfig,
        index: PoolIndex,
        promoter_id: int,
        store: RemoteStore,
        breaker: CircuitBreaker,
        arena: np.ndarray,
        counters: RemoteCounters,
        costs: PromotionCosts,
        submit: Callable[[Callable, tuple, Callable], None],
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.index = index
        self.promoter_id = promoter_id
        self.store = store
        self.breaker = breaker
        self.counters = counters
        self.costs = costs
        self._arena = arena
        self._submit = submit  # runs fn(*args) on a reader thread, then on_result(result) on the loop thread
        self._clock = clock
        self._is_closed = False
        self._jobs: set[PromotingLookup] = set()
        self._job_of_key: dict[bytes, PromotingLookup] = {}
        self._in_copy: set[int] = set()  # reservations whose pages a reader thread may still write

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def in_copy(self) -> set[int]:
        """Reservations whose pages a reader thread may still write (a fetch or a copy under way): they must not
        expire before their result is back."""
        return self._in_copy

    @property
    def num_waiting(self) -> int:
        """Jobs whose lookups still wait: those count against ``max_promotions``. A job answered at its
        deadline whose fetch has not come back yet holds only its reservations, not a promotion slot."""
        return sum(not job.is_answered for job in self._jobs)

    def start(
        self,
        keys: list[bytes],
        page_bytes: int,
        num_local: int,
        on_done: Callable[[], None],
        holds_states: bool = False,
    ) -> bool:
        """Go on to the store for ``keys[num_local:]``; True: ``on_done()`` will be called once, later.
        ``holds_states``: the keys are state checkpoints, placed as such (protocol.Reserve.holds_states)."""
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
        if self.num_waiting >= self.config.max_promotions:
            self.counters.promote_busy += 1
            return False
        if not self.breaker.allow():
            return False
        try:
            self.index.allocator.check_page_size(page_bytes)
        except ValueError:
            return False
        local = self.index.entry(keys[num_local - 1]) if num_local else None
        namespace, depth = (local.namespace, local.depth + 1) if local is not None else (None, None)
        parent = keys[num_local - 1] if local is not None else b""
        now = self._clock()
        plan = self.costs.plan(namespace, page_bytes, num_local, len(missing), self.config.promote_timeout_s, now)
        self.counters.cost_checked_lookups += plan.is_costed
        self.counters.skipped_slower_chunks += len(missing) - plan.num_promote
        if plan.num_promote == 0:
            self.counters.skipped_slower_lookups += 1
            if plan.is_remeasure:  # time the store again, in the background: the lookup is answered now
                self.counters.remeasures += 1
                batch_len = max(1, self.config.promote_batch_bytes // page_bytes)
                self._new_job(missing[:batch_len], page_bytes, namespace, depth, [], now, parent, holds_states)
            return False
        job_keys = missing[: plan.num_promote]
        if not self._new_job(job_keys, page_bytes, namespace, depth, [on_done], now, parent, holds_states):
            return False
        self.counters.lookups += 1
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

    def _new_job(
        self,
        keys: list[bytes],
        page_bytes: int,
        namespace: bytes | None,
        depth: int | None,
        waiters: list,
        now: float,
        parent_key: bytes,
        holds_states: bool = False,
    ) -> bool:
        """Start a job; False: its first reserve got no page, so nothing was asked of the store and the job is
        gone already (its waiters are not called: their lookups are answered now, from the arena)."""
        batch_len = max(1, self.config.promote_batch_bytes // page_bytes)
        deadline = now + self.config.promote_timeout_s
        job = PromotingLookup(
            keys,
            page_bytes,
            namespace,
            depth,
            waiters,
            deadline,
            batch_len,
            now,
            parent_key=parent_key,
            holds_states=holds_states,
        )
        self._jobs.add(job)
        for key in keys:
            self._job_of_key.setdefault(key, job)
        self._fetch_more(job)
        if not self._is_done(job):
            return True
        self._forget(job)
        return False

    # -- sending batches ----------------------------------------------------------------

    def _fetch_more(self, job: PromotingLookup) -> None:
        # batches in flight (being fetched, waiting for their turn, being copied): at most num_readers
        while (
            not job.is_ended
            and job.num_asked < len(job.keys)
            and job.outstanding + len(job.arrived) < self.config.num_readers
        ):
            if self._can_land(job):
                self._send_direct(job)
            else:  # first a probe of one page; while it is out, the next batch as values (as a probe is)
                self._send_as_values(job, PROBE_PAGES if job.num_batches == 0 else job.batch_len)

    def _can_land(self, job: PromotingLookup) -> bool:
        """Whether the next batch may be reserved before it is fetched."""
        if job.namespace is None or job.first_depth is None:
            return False
        num = min(job.batch_len, len(job.keys) - job.num_asked)
        return job.is_confirmed or self.index.allocator.num_free_pages(job.page_bytes) >= num

    def _send_as_values(self, job: PromotingLookup, num_keys: int) -> None:
        batch = Batch(job.num_batches, job.num_asked, min(num_keys, len(job.keys) - job.num_asked))
        keys = job.keys[batch.start : batch.start + batch.num_keys]
        args = (self.store, self.breaker, self.config, keys, job.page_bytes, job.namespace, self._fetch_deadline(job))
        self._send(job, batch, W.fetch_pages, args)

    def _send_direct(self, job: PromotingLookup) -> None:
        """Reserve the next batch's pages (one reservation each, so a chain that ends mid-batch keeps its head)."""
        start, now = job.num_asked, self._clock()
        keys = job.keys[start : start + job.batch_len]
        reservations, pages = [], []
        for i, key in enumerate(keys):
            try:
                depth, parent = job.first_depth + start + i, job.parent_of(start + i)
                reserved = self.index.reserve(
                    self.promoter_id,
                    job.namespace,
                    [key],
                    job.page_bytes,
                    depth,
                    now,
                    parent_key=parent,
                    holds_states=job.holds_states,
                )
            except PoolError as exc:
                log.error("remote promotion: reserve refused: %s", exc)
                break
            if not reserved.grants:  # no room, or the chunk appeared here meanwhile: the chain goes no further
                if reserved.num_no_room:
                    self.counters.promote_no_room += len(keys) - i  # this one and the rest of its batch
                break
            reservations.append(reserved.reservation_id)
            pages.append((key, reserved.grants[0][1].offset))
        if len(pages) < len(keys):
            job.is_ended = True
        if not pages:
            job.break_chain()
            return
        batch = Batch(job.num_batches, start, len(pages), tuple(reservations))
        self._in_copy.update(batch.reservations)
        fetch = functools.partial(fetch_into, deadline=self._fetch_deadline(job))
        args = (self.store, self.breaker, self.config, self._arena, pages, job.page_bytes, job.namespace)
        self._send(job, batch, fetch, (*args, job.first_depth + start))

    def _fetch_deadline(self, job: PromotingLookup) -> float:
        """No fetch of ``job`` receives after this: its lookups' deadline, and one store timeout more for a batch
        sent just before it (RemoteConfig.check_reservation_ttl keeps it well inside the reservations' TTL)."""
        return job.deadline + self.config.timeout_s

    def _send(self, job: PromotingLookup, batch: Batch, fn: Callable, args: tuple) -> None:
        job.num_asked += batch.num_keys
        job.num_batches += 1
        job.outstanding += 1
        self._submit(fn, args, functools.partial(self._on_fetched, job, batch))

    # -- results, in chain order ----------------------------------------------------------

    def _on_fetched(self, job: PromotingLookup, batch: Batch, result) -> None:
        job.outstanding -= 1
        self._in_copy.difference_update(batch.reservations)  # the thread is done with their pages
        job.arrived[batch.number] = (batch, result)
        while job.num_applied in job.arrived:
            applied = job.arrived.pop(job.num_applied)
            try:
                self._apply(job, *applied)
            except Exception:  # a bug, or a reservation that expired meanwhile: the job ends here all the same
                log.exception("remote promotion: applying a fetched batch failed")
                self._abort(applied[0].reservations)
                job.break_chain()
            job.num_applied += 1
        self._fetch_more(job)
        self._maybe_finish(job)

    def _apply(self, job: PromotingLookup, batch: Batch, result) -> None:
        if isinstance(result, BaseException):
            log.error("remote fetch failed: %r", result)
            self._abort(batch.reservations)
            job.break_chain()
            return
        self.counters.count_fetch(result, is_in_chain=not job.is_broken)
        if isinstance(result, LandedResult):
            self._apply_landed(job, batch, result)
        else:
            self._apply_values(job, batch, result)

    def _apply_landed(self, job: PromotingLookup, batch: Batch, result: LandedResult) -> None:
        """Commit the batch's pages that landed whole and valid; abort the rest."""
        good = 0 if job.is_broken or self._is_closed else len(result.checksums)
        for reservation_id, checksum in reversed(list(zip(batch.reservations[:good], result.checksums))):
            self.index.commit(self.promoter_id, reservation_id, [checksum])  # tail first: the head most recent
        self._abort(batch.reservations[good:])
        self._pin(job, job.keys[batch.start : batch.start + good])
        self._count_promoted(job, good)
        if good:
            job.is_confirmed = True
        if result.end is not None or good < batch.num_keys:
            job.break_chain()

    def _apply_values(self, job: PromotingLookup, batch: Batch, result: W.FetchResult) -> None:
        """Count a batch fetched as values and, while the chain is unbroken, place its pages."""
        if job.is_broken or self._is_closed:
            return  # fetched ahead of a chunk that broke the chain: not part of it
        pages = result.pages
        if job.namespace is not None:  # a batch fetched before the chain's namespace was known
            same = [p.meta.namespace == job.namespace for p in pages]
            if not all(same):
                pages = pages[: same.index(False)]
                self.counters.count_fetch(
                    W.FetchResult([], None, discarded=[("fingerprint", "chunk of another namespace")])
                )
                job.break_chain()
        if pages:
            job.namespace = pages[0].meta.namespace
            job.first_depth = pages[0].meta.depth - batch.start
            job.is_confirmed = True
            self._place(job, pages)
        if result.end is not None or len(pages) < batch.num_keys:
            job.break_chain()

    def _count_promoted(self, job: PromotingLookup, num_pages: int) -> None:
        job.num_found += num_pages
        job.num_promoted_bytes += num_pages * job.page_bytes
        self.counters.promoted_pages += num_pages
        self.counters.promoted_bytes += num_pages * job.page_bytes

    def _pin(self, job: PromotingLookup, keys: list[bytes]) -> None:
        """Lease committed pages until the lookups are answered: a later batch's reserve must not evict them."""
        if keys:
            pin = self.index.lookup(self.promoter_id, keys, job.page_bytes, self._clock(), is_counted=False)
            if pin.lease_id:
                job.pins.append(pin.lease_id)

    def _unpin(self, job: PromotingLookup) -> None:
        pins, job.pins = job.pins, []
        for lease_id in pins:
            try:
                self.index.release(self.promoter_id, lease_id)
            except PoolError:
                pass  # expired meanwhile (a promotion far past its timeout)

    def _abort(self, reservations) -> None:
        for reservation_id in reservations:
            try:
                self.index.abort(self.promoter_id, reservation_id)
            except PoolError:
                pass  # committed, or aborted by its TTL, already

    def _place(self, job: PromotingLookup, pages: list[RemotePage]) -> None:
        """Reserve arena pages (as the promoter) for fetched pages and have a thread copy them in."""
        keys, depth = [p.meta.key for p in pages], pages[0].meta.depth
        parent = job.parent_of(depth - job.first_depth) if depth > 0 else b""
        try:
            reserved = self.index.reserve(
                self.promoter_id,
                job.namespace,
                keys,
                job.page_bytes,
                depth,
                self._clock(),
                parent_key=parent,
                holds_states=job.holds_states,
            )
        except PoolError as exc:
            log.error("remote promotion: reserve refused: %s", exc)
            job.break_chain()
            return
        if reserved.num_no_room:
            self.counters.promote_no_room += reserved.num_no_room
            job.break_chain()
        if not reserved.grants:
            return
        placements = [(pages[i], entry.offset) for i, entry in reserved.grants]
        job.outstanding += 1
        self._in_copy.add(reserved.reservation_id)
        on_copied = functools.partial(self._on_copied, job, reserved.reservation_id, placements)
        self._submit(W.copy_pages, (self._arena, placements), on_copied)

    def _on_copied(
        self,
        job: PromotingLookup,
        reservation_id: int,
        placements: list[tuple[RemotePage, int]],
        result: list[int] | BaseException,
    ) -> None:
        job.outstanding -= 1
        self._in_copy.discard(reservation_id)  # the thread is done with its pages
        expected = [page.meta.checksum for page, _ in placements]
        if isinstance(result, BaseException) or result != expected:
            bad = (
                len(placements) if isinstance(result, BaseException) else sum(a != b for a, b in zip(result, expected))
            )
            log.error("remote promotion: %d page(s) differ from their checksum after the copy: %r", bad, result)
            self._abort([reservation_id])
            self.counters.discarded_checksum += bad
            job.break_chain()
        else:
            try:
                self.index.commit(self.promoter_id, reservation_id, expected)
            except PoolError as exc:  # aborted by its TTL meanwhile: the chain ends here
                log.error("remote promotion: commit refused: %s", exc)
                job.break_chain()
            else:
                self._pin(job, [page.meta.key for page, _ in placements])
                self._count_promoted(job, len(placements))
        self._fetch_more(job)  # a batch's memory is free again
        self._maybe_finish(job)

    @staticmethod
    def _is_done(job: PromotingLookup) -> bool:
        """No fetch or copy is out, and none will be sent."""
        return not job.outstanding and (job.is_ended or job.num_asked >= len(job.keys))

    def _forget(self, job: PromotingLookup) -> None:
        self._jobs.discard(job)
        for key in job.keys:
            if self._job_of_key.get(key) is job:
                del self._job_of_key[key]

    def _maybe_finish(self, job: PromotingLookup) -> None:
        if not self._is_done(job):
            return
        self._forget(job)
        now = self._clock()
        self.costs.record_fetch(job.num_promoted_bytes, now - job.started_at, now)
        self.counters.hit_chunks += job.num_found
        self.counters.miss_chunks += len(job.keys) - job.num_found
        self._answer(job)  # the waiters' lookups lease the pages before the pins go
        self._unpin(job)

    def _answer(self, job: PromotingLookup) -> None:
        job.is_answered = True
        waiters, job.waiters = job.waiters, []
        for on_done in waiters:
            try:
                on_done()
            except Exception:
                log.exception("remote tier: answering a deferred lookup failed")
