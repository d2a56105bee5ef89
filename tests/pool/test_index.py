import hashlib

import pytest

from kvshare.pool.allocator import Allocator
from kvshare.pool.entries import EntryState
from kvshare.pool.index import IndexConfig, PoolError, PoolIndex

MiB = 1 << 20
PAGE = 1 * MiB
NS = b"n" * 16


def keys(tag, n):
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(n)]


def make(pages=16, **cfg):
    return PoolIndex(Allocator(pages * PAGE, 4 * PAGE), IndexConfig(**cfg))


def store(index, ks, client=1, depth=0):
    res = index.reserve(client, NS, ks, PAGE, depth, now=0.0)
    if res.reservation_id:
        index.commit(client, res.reservation_id, [i for i, _ in res.grants])
    return res


def test_writing_is_invisible_until_commit():
    index = make()
    ks = keys("a", 3)
    res = index.reserve(1, NS, ks, PAGE, 0, now=0.0)
    assert len(res.grants) == 3
    assert index.lookup(2, ks, PAGE, now=0.0).entries == []
    assert index.reserve(2, NS, ks, PAGE, 0, now=0.0).grants == []  # someone is writing them
    index.commit(1, res.reservation_id, [11, 12, 13])
    found = index.lookup(2, ks, PAGE, now=0.0)
    assert [e.checksum for e in found.entries] == [11, 12, 13]
    index.check_integrity()


def test_longest_committed_prefix_and_lease_pins():
    index = make()
    ks = keys("a", 4)
    store(index, ks[:2])
    store(index, ks[3:], depth=3)  # a stranded tail: not reachable without chunk 2
    result = index.lookup(5, ks, PAGE, now=0.0)
    assert len(result.entries) == 2 and result.lease_id
    assert all(e.num_leases == 1 for e in result.entries)
    with pytest.raises(PoolError) as err:
        index.release(6, result.lease_id)
    assert err.value.code == "not_owner"
    index.release(5, result.lease_id)
    with pytest.raises(PoolError):
        index.release(5, result.lease_id)  # double release
    index.check_integrity()


def test_only_owner_commits_and_double_commit_fails():
    index = make()
    res = index.reserve(1, NS, keys("a", 2), PAGE, 0, now=0.0)
    with pytest.raises(PoolError) as err:
        index.commit(2, res.reservation_id, [0, 0])
    assert err.value.code == "not_owner"
    with pytest.raises(PoolError):
        index.commit(1, res.reservation_id, [0])  # wrong number of checksums: nothing changes
    index.commit(1, res.reservation_id, [0, 0])
    with pytest.raises(PoolError):
        index.commit(1, res.reservation_id, [0, 0])
    index.check_integrity()


def test_disconnect_aborts_and_releases():
    index = make()
    store(index, keys("a", 2))
    lease = index.lookup(7, keys("a", 2), PAGE, now=0.0)
    index.reserve(7, NS, keys("b", 3), PAGE, 0, now=0.0)
    assert index.disconnect(7) == (1, 1)
    assert index.num_leases == 0 and index.num_writing == 0
    assert all(e.num_leases == 0 for e in lease.entries)
    assert index.lookup(1, keys("b", 3), PAGE, now=0.0).entries == []
    index.check_integrity()


def test_lru_evicts_tail_before_head_and_never_leased_or_writing():
    index = make(pages=8, high_watermark=1.0, low_watermark=1.0)
    chain = keys("chain", 4)
    store(index, chain)
    leased = keys("leased", 2)
    store(index, leased)
    pinned = index.lookup(2, leased, PAGE, now=0.0)
    writing = index.reserve(3, NS, keys("w", 1), PAGE, 0, now=0.0)
    assert writing.grants
    # one free page left; ask for 3: the chain's tail goes first
    res = index.reserve(4, NS, keys("new", 3), PAGE, 0, now=0.0)
    assert len(res.grants) == 3
    assert [index.entry(k) is not None for k in chain] == [True, True, False, False]
    assert all(index.entry(k) is not None for k in leased)
    assert index.entry(keys("w", 1)[0]).state is EntryState.WRITING
    # everything else is pinned or being written: no room, and the reserve says so
    res2 = index.reserve(4, NS, keys("more", 5), PAGE, 0, now=0.0)
    assert len(res2.grants) == 2 and res2.num_no_room == 3
    assert index.counters.skipped_stores == 3
    index.release(2, pinned.lease_id)
    index.check_integrity()


def test_lookup_refreshes_the_chain():
    index = make(pages=4, high_watermark=1.0, low_watermark=1.0)
    old, new = keys("old", 2), keys("new", 2)
    store(index, old)
    store(index, new)
    index.release(9, index.lookup(9, old, PAGE, now=0.0).lease_id)  # old becomes most recent
    store(index, keys("x", 1))
    assert index.entry(new[1]) is None and index.entry(new[0]) is not None
    assert all(index.entry(k) is not None for k in old)


def test_watermarks():
    index = make(pages=16, high_watermark=0.75, low_watermark=0.5)
    for i in range(13):
        store(index, keys(f"s{i}", 1))
    assert index.allocator.used_bytes <= 0.75 * 16 * PAGE
    assert index.counters.evictions > 0
    index.check_integrity()


def test_lease_expiry_and_drop_of_leased_entry():
    index = make(lease_ttl_s=10.0)
    ks = keys("a", 2)
    store(index, ks)
    index.lookup(1, ks, PAGE, now=0.0)  # leased: the drop frees the pages only after the lease
    assert index.drop(ks) == 2
    assert index.lookup(1, ks, PAGE, now=0.0).entries == []
    used = index.allocator.used_bytes
    assert used == 2 * PAGE  # still leased: the pages stay until released
    index.check_integrity()
    assert index.expire(now=11.0) == 1
    assert index.allocator.used_bytes == 0
    index.check_integrity()


def test_flush_by_namespace():
    index = make()
    store(index, keys("a", 2))
    res = index.reserve(1, b"m" * 16, keys("b", 2), PAGE, 0, now=0.0)
    index.commit(1, res.reservation_id, [0, 0])
    assert index.flush(NS) == 2
    assert index.num_entries == 2
    assert index.flush() == 2
    index.check_integrity()


def test_bad_requests_leave_index_intact():
    index = make()
    store(index, keys("a", 2))
    for call in (
        lambda: index.lookup(1, [b"short"], PAGE, now=0.0),
        lambda: index.lookup(1, keys("x", 5000), PAGE, now=0.0),
        lambda: index.reserve(1, b"bad", keys("c", 1), PAGE, 0, now=0.0),
        lambda: index.reserve(1, NS, keys("c", 1), 100 * PAGE, 0, now=0.0),
        lambda: index.reserve(1, NS, keys("c", 1) * 2, PAGE, 0, now=0.0),
        lambda: index.reserve(1, NS, keys("c", 1), PAGE, -1, now=0.0),
        lambda: index.abort(1, 12345),
    ):
        with pytest.raises(PoolError):
            call()
    assert index.num_entries == 2 and index.num_writing == 0
    index.check_integrity()


def test_a_reservation_nobody_commits_is_aborted_after_its_ttl():
    """A writer that never commits nor aborts (its process alive, its connection gone) holds its pages only
    until reservation_ttl_s. Fails when reservations never expire (expire() only looks at leases)."""
    index = make(reservation_ttl_s=60.0)
    res = index.reserve(1, NS, keys("w", 2), PAGE, 0, now=0.0)
    assert index.expire_reservations(now=59.0) == [] and index.num_writing == 2
    assert index.expire_reservations(now=60.0) == [res.reservation_id]
    assert index.num_writing == 0 and index.allocator.used_bytes == 0 and index.counters.expired_reservations == 1
    with pytest.raises(PoolError, match="does not exist"):  # a late commit is refused, never made visible
        index.commit(1, res.reservation_id, [1, 2])
    index.check_integrity()


def test_eviction_for_another_page_size_takes_only_extents_nobody_holds():
    """Room for a page size the arena lacks comes only from whole extents where no page is leased or being
    written: in a held extent, evicting the other pages frees nothing for the new size and only destroys that
    model's cache. Fails when such a reserve evicts every unleased entry in LRU order."""
    index = make(pages=8, high_watermark=1.0, low_watermark=1.0)  # 2 extents of 4 pages
    held, idle = keys("held", 4), keys("idle", 4)
    store(index, held)  # extent 0
    store(index, idle)  # extent 1
    lease = index.lookup(2, held[:1], PAGE, now=0.0)  # a reader copies the first page of extent 0
    index.lookup(3, idle + held, PAGE, now=0.0, lease=False)  # extent 1 most recently used, extent 0 oldest
    big = index.reserve(4, NS, keys("big", 1), 4 * PAGE, 0, now=0.0)
    assert len(big.grants) == 1 and big.grants[0][1].offset == 4 * PAGE  # extent 1, emptied whole
    assert [e is not None for e in map(index.entry, held)] == [True] * 4  # the held extent kept its cache
    assert index.lookup(5, held, PAGE, now=0.0).entries  # and still serves it
    assert index.reserve(4, NS, keys("big2", 1), 4 * PAGE, 0, now=0.0).num_no_room == 1  # nothing else to take
    assert len(index.lookup(5, held, PAGE, now=0.0, lease=False).entries) == 4
    index.release(2, lease.lease_id)
    index.check_integrity()
