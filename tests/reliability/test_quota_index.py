"""The per-namespace quota of the pool's index (pure: no process, no socket).

A namespace (a model and tenant) over its quota evicts its own least recently
used chunks, then is granted fewer pages; another namespace's chunks, leased
chunks and the chain being stored are never touched.
"""

import hashlib

import pytest

from kvshare.pool.allocator import Allocator
from kvshare.pool.index import IndexConfig, PoolError, PoolIndex

MiB = 1 << 20
PAGE = 1 * MiB
A, B = b"A" * 16, b"B" * 16


def keys(tag, n):
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(n)]


def make(pages=32, quota_pages=4):
    config = IndexConfig(high_watermark=1.0, low_watermark=1.0, namespace_quota_bytes=quota_pages * PAGE)
    return PoolIndex(Allocator(pages * PAGE, 8 * PAGE), config)


def store(index, ns, ks, client=1):
    res = index.reserve(client, ns, ks, PAGE, 0, now=0.0)
    if res.reservation_id:
        index.commit(client, res.reservation_id, [0] * len(res.grants))
    return res


def held(index, owner):
    """Bytes the quota charges ``owner`` (an account, or a namespace written without one)."""
    return {row[0]: row[2] for row in index.accounts()}.get(owner, 0)


def test_over_quota_evicts_own_lru_and_never_other_namespaces():
    index = make(quota_pages=4)
    old_a, old_b = keys("a-old", 4), keys("b-old", 4)
    store(index, A, old_a)
    store(index, B, old_b)
    index.lookup(1, old_a, PAGE, now=0.0, lease=False)  # B's are now the oldest: a global LRU would evict them first
    new_a = keys("a-new", 3)
    res = store(index, A, new_a)
    assert len(res.grants) == 3 and res.num_no_room == 0
    assert index.counters.quota_evictions == 3 and index.counters.evictions == 0
    assert held(index, A) == 4 * PAGE and held(index, B) == 4 * PAGE
    assert len(index.lookup(2, old_b, PAGE, now=0.0, lease=False).entries) == 4  # B untouched
    assert len(index.lookup(2, new_a, PAGE, now=0.0, lease=False).entries) == 3
    # A's oldest chain lost its tail first (a chain's tail is older than its head in the LRU)
    assert len(index.lookup(2, old_a, PAGE, now=0.0, lease=False).entries) == 1
    index.check_integrity()


def test_leased_pages_count_and_are_never_evicted_so_fewer_pages_are_granted():
    index = make(quota_pages=4)
    ks = keys("a", 4)
    store(index, A, ks)
    lease = index.lookup(7, ks, PAGE, now=0.0)  # a reader pins all four
    res = store(index, A, keys("a2", 2))
    assert res.grants == [] and res.num_no_room == 2
    assert index.counters.quota_skipped_pages == 2 and index.counters.quota_evictions == 0
    assert all(e.num_leases == 1 for e in lease.entries)
    index.release(7, lease.lease_id)
    res = store(index, A, keys("a2", 2))
    assert len(res.grants) == 2 and index.counters.quota_evictions == 2
    index.check_integrity()


def test_a_chain_longer_than_the_quota_keeps_its_head_and_its_own_earlier_chunks():
    index = make(quota_pages=4)
    chain = keys("long", 6)
    store(index, A, chain[:2])  # the first two chunks were stored by an earlier request
    res = store(index, A, chain)  # now the whole chain: only two more fit, and the stored head stays
    assert [i for i, _ in res.grants] == [2, 3] and res.num_no_room == 2
    assert len(index.lookup(1, chain, PAGE, now=0.0, lease=False).entries) == 4
    assert held(index, A) == 4 * PAGE
    index.check_integrity()


def test_writing_pages_count_against_the_quota_and_aborts_give_them_back():
    index = make(quota_pages=3)
    res = index.reserve(1, A, keys("w", 3), PAGE, 0, now=0.0)
    assert len(res.grants) == 3
    assert index.reserve(2, A, keys("x", 1), PAGE, 0, now=0.0).num_no_room == 1  # nothing committed to evict
    assert index.reserve(2, B, keys("x", 1), PAGE, 0, now=0.0).grants  # another namespace is not limited by A
    index.disconnect(1)  # the writer died: its reservation is aborted
    assert held(index, A) == 0
    assert len(index.reserve(3, A, keys("y", 3), PAGE, 0, now=0.0).grants) == 3
    index.check_integrity()


def test_dropped_but_leased_pages_stay_counted_until_freed_and_flush_frees_them():
    index = make(quota_pages=4)
    ks = keys("d", 2)
    store(index, A, ks)
    lease = index.lookup(5, ks, PAGE, now=0.0)
    assert index.flush(A) == 2
    assert held(index, A) == 2 * PAGE  # the pages still hold bytes a reader is copying
    index.check_integrity()
    index.release(5, lease.lease_id)
    assert held(index, A) == 0 and index.num_namespaces == 0
    index.check_integrity()


def test_no_quota_by_default_and_config_is_validated():
    index = PoolIndex(Allocator(8 * PAGE, 8 * PAGE), IndexConfig(high_watermark=1.0, low_watermark=1.0))
    assert len(store(index, A, keys("a", 8)).grants) == 8
    with pytest.raises(ValueError):
        IndexConfig(namespace_quota_bytes=-1)


from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

QUOTA_PAGES = 3
NAMESPACES = (A, B, b"C" * 16)


class QuotaMachine(RuleBasedStateMachine):
    """Random reserves, commits, aborts, lookups, releases, drops, flushes and disconnects of three clients in
    three namespaces: the index stays consistent, no namespace holds more than its quota, and a reserve
    removes entries of its own namespace only."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PoolIndex(
            Allocator(16 * PAGE, 4 * PAGE),
            IndexConfig(high_watermark=0.9, low_watermark=0.7, namespace_quota_bytes=QUOTA_PAGES * PAGE),
        )
        self.reservations: list[tuple[int, int, int]] = []  # (client, reservation id, pages)
        self.leases: list[tuple[int, int]] = []

    def _visible(self) -> dict[bytes, set[bytes]]:
        out: dict[bytes, set[bytes]] = {}
        for entry in self.index._lru.values():
            out.setdefault(entry.namespace, set()).add(entry.key)
        return out

    @rule(client=st.integers(1, 3), ns=st.sampled_from(NAMESPACES), tag=st.integers(0, 5), n=st.integers(1, 5))
    def reserve(self, client, ns, tag, n):
        before = self._visible()
        res = self.index.reserve(client, ns, keys(f"{ns[:1]}{tag}", n), PAGE, 0, now=0.0)
        after = self._visible()
        if self.index.allocator.used_bytes <= 0.9 * self.index.allocator.arena_bytes:
            for other in NAMESPACES:  # without global pressure, only the reserving namespace may lose entries
                if other != ns:
                    assert before.get(other, set()) <= after.get(other, set())
        if res.reservation_id:
            self.reservations.append((client, res.reservation_id, len(res.grants)))

    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data, commit):
        if not self.reservations:
            return
        client, rid, pages = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
        if commit:
            self.index.commit(client, rid, [0] * pages)
        else:
            self.index.abort(client, rid)

    @rule(client=st.integers(1, 3), ns=st.sampled_from(NAMESPACES), tag=st.integers(0, 5))
    def lookup(self, client, ns, tag):
        result = self.index.lookup(client, keys(f"{ns[:1]}{tag}", 5), PAGE, now=0.0)
        if result.lease_id:
            self.leases.append((client, result.lease_id))

    @rule(data=st.data())
    def release(self, data):
        if self.leases:
            client, lease_id = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
            self.index.release(client, lease_id)

    @rule(ns=st.sampled_from(NAMESPACES + (None,)))
    def flush(self, ns):
        self.index.flush(ns)

    @rule(client=st.integers(1, 3))
    def disconnect(self, client):
        self.index.disconnect(client)
        self.reservations = [r for r in self.reservations if r[0] != client]
        self.leases = [lease for lease in self.leases if lease[0] != client]

    @invariant()
    def consistent_and_within_quota(self):
        self.index.check_integrity()
        for ns, _, num_bytes in self.index.namespaces():
            assert num_bytes <= QUOTA_PAGES * PAGE, (ns, num_bytes)


TestQuotaMachine = QuotaMachine.TestCase
TestQuotaMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


ACCOUNT_A, ACCOUNT_B = b"a" * 16, b"b" * 16


def store_as(index, ns, ks, account):
    res = index.reserve(1, ns, ks, PAGE, 0, now=0.0, account=account)
    if res.reservation_id:
        index.commit(1, res.reservation_id, [0] * len(res.grants))
    return res


def test_an_account_holds_one_quota_across_all_its_namespaces():
    """Namespaces differ per cache_salt; an account charges them all to one quota (fails when the index
    charges the namespace instead of the account: each salt would get its own quota)."""
    index = make(quota_pages=4)
    salted = [hashlib.blake2b(f"salt{i}".encode(), digest_size=16).digest() for i in range(5)]
    for i, ns in enumerate(salted):
        store_as(index, ns, keys(f"s{i}", 3), ACCOUNT_A)
    assert held(index, ACCOUNT_A) == 4 * PAGE and index.allocator.used_bytes == 4 * PAGE
    assert index.counters.quota_evictions == 11  # each new salt evicted the account's oldest chunks
    assert len(index.lookup(2, keys("s4", 3), PAGE, now=0.0, lease=False).entries) == 3  # the newest stays whole
    index.check_integrity()


def test_two_accounts_keep_their_own_quota_and_no_account_is_charged_per_namespace():
    index = make(quota_pages=4)
    store_as(index, A, keys("a", 4), ACCOUNT_A)
    store_as(index, B, keys("b", 4), ACCOUNT_B)
    store_as(index, B, keys("b2", 2), ACCOUNT_B)  # B over its quota evicts its own, never A's
    assert held(index, ACCOUNT_A) == 4 * PAGE and held(index, ACCOUNT_B) == 4 * PAGE
    assert len(index.lookup(2, keys("a", 4), PAGE, now=0.0, lease=False).entries) == 4
    # a writer that names no account (an older client) is charged per namespace, as before accounts existed
    c = b"C" * 16
    store_as(index, c, keys("c", 6), b"")
    assert held(index, c) == 4 * PAGE and held(index, ACCOUNT_A) == 4 * PAGE
    index.check_integrity()


def test_an_account_of_the_wrong_length_is_refused():
    index = make()
    with pytest.raises(PoolError, match="account must be 16 bytes"):
        index.reserve(1, A, keys("a", 1), PAGE, 0, now=0.0, account=b"short")
    assert index.allocator.used_bytes == 0
