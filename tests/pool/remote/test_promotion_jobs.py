"""Promotion jobs end on every path: driven on the loop thread's side with a fake reader pool (no Redis)."""

from __future__ import annotations

import hashlib

import numpy as np

from kvshare.pool.allocator import Allocator
from kvshare.pool.index import IndexConfig, PoolIndex
from kvshare.pool.remote.breaker import CircuitBreaker
from kvshare.pool.remote.config import RemoteConfig
from kvshare.pool.remote.cost import PromotionCosts
from kvshare.pool.remote.counters import RemoteCounters
from kvshare.pool.remote.direct import LandedResult
from kvshare.pool.remote.promotion import Promotions

PAGE = 4096
NS = b"n" * 16
PROMOTER = 99


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(n)]


class Clock:
    now = 10.0

    def __call__(self) -> float:
        return self.now


def make(index: PoolIndex, clock: Clock, num_readers: int = 1):
    """Promotions whose fetches never start: each submitted task waits in ``tasks`` for the test to finish it."""
    tasks: list[tuple] = []
    config = RemoteConfig("redis://127.0.0.1:1", promote_timeout_s=1.0, max_promotions=2, num_readers=num_readers)
    arena = np.zeros(index.allocator.arena_bytes, dtype=np.uint8)
    promotions = Promotions(
        config,
        index,
        PROMOTER,
        store=None,
        breaker=CircuitBreaker(3, 5.0),
        arena=arena,
        counters=RemoteCounters(),
        costs=PromotionCosts(),
        submit=lambda fn, args, on_result: tasks.append((fn, args, on_result)),
        clock=clock,
    )
    return promotions, tasks


def local_head(index: PoolIndex, tag: str) -> list[bytes]:
    """A chain whose first chunk the arena holds, so promotion reserves the rest before it fetches."""
    chain = keys(tag, 3)
    reserved = index.reserve(1, NS, chain[:1], PAGE, 0, 0.0)
    index.commit(1, reserved.reservation_id, [0])
    return chain


def test_hung_fetches_answered_at_their_deadline_do_not_turn_promotion_off():
    """Fails when promotions count every job still in flight (``len(self._jobs)``) against max_promotions:
    two fetches that never come back then turn promotion off for good."""
    clock = Clock()
    index = PoolIndex(Allocator(64 * PAGE, 16 * PAGE))
    promotions, tasks = make(index, clock)
    answered = []
    for tag in ("a", "b"):
        chain = local_head(index, tag)
        assert promotions.start(chain, PAGE, 1, lambda tag=tag: answered.append(tag))
    assert not promotions.start(local_head(index, "c"), PAGE, 1, lambda: None)  # both slots busy
    clock.now += 2.0
    promotions.tick(clock.now)  # the deadline: the lookups are answered, the fetches still hang
    assert sorted(answered) == ["a", "b"]
    assert promotions.start(local_head(index, "d"), PAGE, 1, lambda: None)
    assert index.num_reservations >= 2  # the hung fetches' pages stay reserved: a thread may still write them
    index.check_integrity()


def test_a_fetch_that_lands_after_its_reservation_expired_ends_the_job():
    """Fails when a commit refused for an expired reservation escapes ``_on_fetched``: the job then never ends,
    stays counted, and its keys stay claimed."""
    clock = Clock()
    index = PoolIndex(Allocator(64 * PAGE, 16 * PAGE), IndexConfig(reservation_ttl_s=30.0))
    promotions, tasks = make(index, clock)
    chain = local_head(index, "a")
    assert promotions.start(chain, PAGE, 1, lambda: None)
    ((fn, args, on_result),) = tasks
    clock.now += 60.0
    index.expire_reservations(clock.now)  # the writer hung past the reservation TTL
    assert index.num_reservations == 0
    on_result(LandedResult(checksums=[1, 2], end=None))  # the thread comes back at last
    assert len(promotions) == 0 and promotions.num_waiting == 0
    assert promotions.start(chain, PAGE, 1, lambda: None)  # the keys are free to promote again
    index.check_integrity()


def announced(index: PoolIndex):
    """The index's KV events, as a subscriber of the pool's publisher gets them."""
    from kvshare.pool.event_publisher import KVEventsConfig, PoolEvents
    from tests.pool.test_events import ListPublisher, stored

    publisher = ListPublisher()
    index.listener = PoolEvents(KVEventsConfig(endpoint="ipc:///unused", hash_kind="bytes"), publisher)
    return lambda: [(e.block_hashes[0], e.parent_block_hash) for e in stored(publisher)]


def test_pages_promoted_past_a_held_head_are_announced_each_naming_its_parent():
    """A chain whose head the arena holds, its rest reserved and landed from the store (the direct path). Fails
    when promotion reserves pages without their parent: only the head is announced (a page past chunk 0 whose
    parent is not named never is), so no router sees the rest."""
    clock = Clock()
    index = PoolIndex(Allocator(64 * PAGE, 16 * PAGE))
    events = announced(index)
    chain = local_head(index, "a")
    promotions, tasks = make(index, clock)
    assert promotions.start(chain, PAGE, 1, lambda: None)
    ((_, _, on_result),) = tasks
    on_result(LandedResult(checksums=[1, 2], end=None))
    assert events() == [(chain[0], None), (chain[1], chain[0]), (chain[2], chain[1])]
    index.check_integrity()


def test_pages_fetched_as_values_after_the_probe_are_announced_each_naming_its_parent():
    """A chain the arena lacks entirely: chunk 0 fetched as the probe, chunks 1-2 as values beside it. Fails when
    the second batch is reserved without the probe's chunk as its parent (then only chunk 0 is announced)."""
    from kvshare.pool.checksum import page_checksum
    from kvshare.pool.remote import workers as W
    from kvshare.pool.remote.format import PageMeta, RemotePage

    clock = Clock()
    index = PoolIndex(Allocator(64 * PAGE, 16 * PAGE))
    events = announced(index)
    chain = keys("v", 3)
    promotions, tasks = make(index, clock, num_readers=2)
    assert promotions.start(chain, PAGE, 0, lambda: None)
    payload = np.full(PAGE, 7, dtype=np.uint8)
    page = lambda depth: RemotePage(PageMeta(chain[depth], NS, depth, PAGE, page_checksum(payload)), [payload.data])
    probe, rest = tasks[:2]
    rest[2](W.FetchResult([page(1), page(2)], None))  # waits for the probe's turn
    probe[2](W.FetchResult([page(0)], None))
    for fn, args, on_result in tasks[2:]:  # the copies into the arena, each committed when its checksums match
        on_result(fn(*args))
    assert events() == [(chain[0], None), (chain[1], chain[0]), (chain[2], chain[1])]
    index.check_integrity()


def test_reservations_a_fetch_may_still_write_outlive_their_ttl_until_it_is_back():
    """Fails when a reservation expires while a reader thread may still receive into its pages (the page would
    go to another writer under the fetch), or when promotion does not say which reservations those are."""
    clock = Clock()
    index = PoolIndex(Allocator(64 * PAGE, 16 * PAGE), IndexConfig(reservation_ttl_s=30.0))
    promotions, tasks = make(index, clock)
    chain = local_head(index, "a")
    assert promotions.start(chain, PAGE, 1, lambda: None)
    ((_, _, on_result),) = tasks
    assert len(promotions.in_copy) == 2 and index.num_reservations == 2
    clock.now += 60.0
    assert index.expire_reservations(clock.now, promotions.in_copy) == []  # the fetch is out: kept
    on_result(LandedResult(checksums=[], end="error", num_errors=1))  # back, failed: the loop aborts them
    assert promotions.in_copy == set() and index.num_reservations == 0
    index.check_integrity()


def test_the_pool_never_expires_a_reservation_the_remote_tier_copies_into():
    """The handlers' tick asks the tier which reservations are in a copy. Fails when it expires them by TTL."""
    from tests.pool.test_handlers import FakeRemote
    from tests.pool.test_handlers import make as make_handlers

    remote = FakeRemote()
    handlers, _, clock = make_handlers(remote=remote, reservation_ttl_s=30.0)
    reserved = handlers.index.reserve(PROMOTER, NS, keys("t", 1), 1 << 20, 0, clock.now)
    remote.in_copy = {reserved.reservation_id}
    clock.now += 60.0
    handlers.tick(clock.now)
    assert handlers.index.num_reservations == 1
    remote.in_copy = set()  # the thread is done (and would have aborted it); else its TTL ends it
    handlers.tick(clock.now)
    assert handlers.index.num_reservations == 0


def test_a_promotion_whose_first_reserve_gets_no_page_ends_at_once():
    """The namespace's quota is full with the chain's leased head, so the first direct reserve gets no page though
    the arena has free ones. Fails when that job is left in the table: its lookup then waits the whole promote
    timeout, the job is never finished, and the chunk can never be promoted again."""
    clock = Clock()
    index = PoolIndex(Allocator(64 * PAGE, 16 * PAGE), IndexConfig(namespace_quota_bytes=PAGE))
    promotions, tasks = make(index, clock)
    chain = local_head(index, "a")
    held = index.lookup(1, chain[:1], PAGE, clock.now)  # the lookup's own lease on its local prefix
    answered = []
    assert not promotions.start(chain, PAGE, 1, lambda: answered.append(True))  # answered now, from the arena
    assert tasks == [] and answered == [] and len(promotions) == 0 and promotions.num_waiting == 0
    index.release(1, held.lease_id)  # room again: the chunk may be promoted (the head is evicted for it)
    assert promotions.start(chain, PAGE, 1, lambda: None)
    assert len(tasks) == 1
    index.check_integrity()
