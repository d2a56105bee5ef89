"""State checkpoints in the pool: entries of their own page size beside the KV pages, under their own keys, found by
one lookup that reaches them through the run of KV pages before them (kvshare.pool.index, protocol.Lookup)."""

from __future__ import annotations

from kvshare.keys import state_key
from kvshare.pool import events as E
from kvshare.pool import protocol as P
from kvshare.pool.allocator import Allocator
from kvshare.pool.client import PoolClient
from kvshare.pool.event_publisher import KVEventsConfig, PoolEvents
from kvshare.pool.index import IndexConfig, PoolIndex
from kvshare.pool.spawn import running_pool
from tests.pool.conftest import make_keys
from tests.pool.test_events import ListPublisher, stored

MiB = 1 << 20
PAGE = 1 * MiB  # a KV page
STATE = 3 * MiB // 2  # a checkpoint: another page size, in extents of its own
NS = b"n" * 16


def make(**cfg) -> PoolIndex:
    return PoolIndex(Allocator(32 * MiB, 4 * MiB), IndexConfig(**cfg))


def store_kv(index: PoolIndex, keys: list[bytes], client: int = 1) -> None:
    res = index.reserve(client, NS, keys, PAGE, 0, now=0.0)
    index.commit(client, res.reservation_id, [0] * len(res.grants))


def store_states(index: PoolIndex, chunk_keys: list[bytes], client: int = 1) -> None:
    keys = [state_key(k) for k in chunk_keys]
    res = index.reserve(client, NS, keys, STATE, 0, now=0.0, holds_states=True)
    index.commit(client, res.reservation_id, [7] * len(res.grants))


def candidates(chunk_keys: list[bytes], first: int = 0) -> list[tuple[bytes, int]]:
    """Every chunk end as a candidate, deepest first: (state key, KV keys from chunk ``first`` it needs)."""
    return [(state_key(chunk_keys[j - 1]), max(0, j - first)) for j in range(len(chunk_keys), 0, -1)]


def test_the_deepest_checkpoint_the_run_reaches_is_found_and_leased_with_it():
    index = make()
    chunks = make_keys("c", 6)
    store_kv(index, chunks[:4])  # the run ends at chunk 4
    store_states(index, [chunks[1], chunks[3], chunks[5]])  # checkpoints after 2, 4 and 6 chunks
    found = index.lookup(2, chunks, PAGE, now=0.0, states=candidates(chunks), state_page_bytes=STATE)
    assert len(found.entries) == 4
    index_of, entry = found.state
    assert index_of == 2 and entry.key == state_key(chunks[3])  # after 4 chunks: not 6, past the run
    assert entry.num_leases == 1 and all(e.num_leases == 1 for e in found.entries)
    index.release(2, found.lease_id)
    assert entry.num_leases == 0
    assert (index.counters.state_lookups, index.counters.state_hits) == (1, 1)
    index.check_integrity()


def test_a_checkpoint_is_never_found_by_a_key_of_kv_nor_of_another_page_size():
    index = make()
    chunks = make_keys("d", 3)
    store_kv(index, chunks)
    store_states(index, chunks[:1])
    kv_as_state = [(chunks[2], 0)]  # a KV page's key asked for as a state: not a state
    assert index.lookup(2, chunks, PAGE, 0.0, lease=False, states=kv_as_state, state_page_bytes=PAGE).state is None
    wrong_size = candidates(chunks)
    assert index.lookup(2, chunks, PAGE, 0.0, lease=False, states=wrong_size, state_page_bytes=PAGE).state is None
    assert index.lookup(2, [state_key(chunks[0])], STATE, 0.0).entries  # a plain lookup reads it as a page
    index.check_integrity()


def test_a_checkpoint_evicted_leaves_its_kv_pages_and_kv_evicted_leaves_the_checkpoint_unreachable():
    index = make()
    chunks = make_keys("e", 4)
    store_kv(index, chunks)
    store_states(index, [chunks[1], chunks[3]])
    index.drop([state_key(chunks[3])])  # the deeper checkpoint goes: the shallower one is found, KV intact
    found = index.lookup(2, chunks, PAGE, 0.0, lease=False, states=candidates(chunks), state_page_bytes=STATE)
    assert len(found.entries) == 4 and found.state[1].key == state_key(chunks[1])
    index.drop([chunks[0]])  # the run's head goes: no checkpoint is reachable, though one is held
    found = index.lookup(2, chunks, PAGE, 0.0, lease=False, states=candidates(chunks), state_page_bytes=STATE)
    assert found.entries == [] and found.state is None
    assert index.entry(state_key(chunks[1])) is not None
    index.check_integrity()


def test_checkpoints_are_counted_apart_and_never_announced_as_kv_blocks():
    index = make()
    publisher = ListPublisher()
    index.listener = PoolEvents(KVEventsConfig(endpoint="ipc:///unused", hash_kind="bytes"), publisher)
    chunks = make_keys("f", 2)
    store_kv(index, chunks)
    store_states(index, chunks)
    assert [e.block_hashes for e in stored(publisher)] == [[k] for k in chunks]
    assert (index.num_states, index.state_bytes, index.num_entries) == (2, 2 * STATE, 4)
    index.flush()
    assert (index.num_states, index.state_bytes) == (0, 0)
    removed = [h for e in publisher.events if isinstance(e, E.BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(chunks)
    index.check_integrity()


def test_through_the_daemon_a_lookup_finds_the_checkpoint_and_stats_count_it():
    with running_pool("32MiB", ("--extent-size", "4MiB"), quiet=True) as path, PoolClient(path) as client:
        chunks = make_keys("g", 3)
        reserved = client.reserve(NS, chunks, PAGE)
        client.commit(reserved.reservation_id, [0] * 3)
        checkpoint = [state_key(chunks[1])]
        reserved = client.reserve(NS, checkpoint, STATE, holds_states=True)
        client.commit(reserved.reservation_id, [5])
        wanted = [P.StateCandidate(key=key, num_kv=n) for key, n in candidates(chunks)]
        grant = client.lookup(chunks, PAGE, states=wanted, state_page_bytes=STATE)
        assert grant.num_pages == 3 and grant.state.index == 1 and grant.state.page.page_bytes == STATE
        stats = client.stats()
        assert (stats["checkpoints"], stats["checkpoint_bytes"], stats["entries"]) == (1, STATE, 4)
        client.release([grant.lease_id], wait=True)
        client.check_integrity()


def test_a_candidate_that_needs_no_kv_is_found_without_a_run():
    """A checkpoint before the lookup's first key (the client holds that KV itself) needs none of its pages."""
    index = make()
    chunks = make_keys("h", 2)
    store_states(index, chunks[:1])
    found = index.lookup(2, chunks[1:], PAGE, 0.0, states=[(state_key(chunks[0]), 0)], state_page_bytes=STATE)
    assert found.entries == [] and found.state is not None and found.lease_id
    index.release(2, found.lease_id)
    index.check_integrity()
