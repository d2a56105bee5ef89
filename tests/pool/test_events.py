"""KV events: the index's commits and removals as vLLM events (unit), and on the wire from a running pool."""

import hashlib

import msgspec
import numpy as np
import pytest

from kvshare.pool import events as E
from kvshare.pool.allocator import Allocator
from kvshare.pool.event_publisher import KVEventsConfig, PoolEvents
from kvshare.pool.index import IndexConfig, PoolError, PoolIndex

MiB = 1 << 20
PAGE = MiB
NS = b"n" * 16
CHUNK = 4  # tokens per chunk in these tests


def keys(tag, n):
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(n)]


def tokens_of(tag, n):
    return [sum(tag.encode()) * 100 + i for i in range(n * CHUNK)]


class ListPublisher:
    def __init__(self):
        self.events = []

    def put(self, event):
        self.events.append(event() if callable(event) else event)  # a stored page is built when it is sent

    def close(self):
        pass


def make(pages=16, **cfg):
    index = PoolIndex(Allocator(pages * PAGE, 4 * PAGE), IndexConfig(**cfg))
    pub = ListPublisher()
    index.listener = PoolEvents(KVEventsConfig(endpoint="ipc:///unused", hash_kind="bytes"), pub)
    return index, pub


def store(index, ks, tokens=None, client=1):
    le32 = b"" if tokens is None else np.asarray(tokens, dtype="<u4").tobytes()
    res = index.reserve(client, NS, ks, PAGE, 0, now=0.0, tokens_le32=le32)
    if res.reservation_id:
        index.commit(client, res.reservation_id, [0] * len(res.grants))
    return res


def stored(pub):
    return [e for e in pub.events if isinstance(e, E.BlockStored)]


def removed_hashes(pub):
    return [h for e in pub.events if isinstance(e, E.BlockRemoved) for h in e.block_hashes]


def test_cleared_first_then_pages_announced_only_at_commit_with_parents_and_tokens():
    """Fails when the commit hook is removed from PoolIndex.commit (nothing announced) or moved to reserve."""
    index, pub = make()
    ks, toks = keys("a", 3), tokens_of("a", 3)
    assert pub.events == [E.AllBlocksCleared()]
    res = index.reserve(1, NS, ks, PAGE, 0, now=0.0, tokens_le32=np.asarray(toks, dtype="<u4").tobytes())
    assert stored(pub) == []  # writing: invisible, unannounced
    index.commit(1, res.reservation_id, [1, 2, 3])
    events = stored(pub)
    assert [e.block_hashes for e in events] == [[k] for k in ks]
    assert [e.parent_block_hash for e in events] == [None, ks[0], ks[1]]
    assert [e.token_ids for e in events] == [toks[i * CHUNK : (i + 1) * CHUNK] for i in range(3)]
    assert {(e.medium, e.block_size) for e in events} == {("CPU", CHUNK)}


def test_a_page_whose_parent_was_never_announced_is_not_announced():
    """A chain stored from its middle (parent unknown, or not announced) stays invisible to subscribers."""
    index, pub = make()
    ks = keys("b", 4)
    res = index.reserve(1, NS, ks[2:], PAGE, 2, now=0.0)  # depth 2 onwards: parent not named
    index.commit(1, res.reservation_id, [0, 0])
    assert stored(pub) == []
    store(index, ks)  # now the head: 0 and 1 are new, 2 and 3 already held
    assert [e.block_hashes[0] for e in stored(pub)] == ks[:2]


def test_a_run_stored_from_the_middle_is_announced_when_it_names_its_announced_parent():
    """A writer that stores only the chunks it computed (a vLLM replica after a prefix hit) names the chunk before
    them. Fails when the index ignores ``parent_key`` (the run's first page has no parent: never announced)."""
    index, pub = make()
    ks, toks = keys("m", 5), tokens_of("m", 5)
    store(index, ks[:2], toks[: 2 * CHUNK])
    le32 = np.asarray(toks[2 * CHUNK :], dtype="<u4").tobytes()
    res = index.reserve(1, NS, ks[2:], PAGE, 2, now=0.0, tokens_le32=le32, parent_key=ks[1])
    index.commit(1, res.reservation_id, [0] * 3)
    events = stored(pub)
    assert [e.block_hashes[0] for e in events] == ks
    assert [e.parent_block_hash for e in events] == [None, *ks[:-1]]
    assert events[2].token_ids == toks[2 * CHUNK : 3 * CHUNK]


def test_a_page_whose_named_parent_is_not_announced_waits_for_it():
    """Stored while its parent was evicted, a run is announced once the parent is stored again (after it, naming
    it); a waiting page that leaves the pool first is never announced. Fails without the waiting list."""
    index, pub = make()
    ks, toks = keys("w", 4), tokens_of("w", 4)
    for depth in (2, 3):  # chunk 2 names chunk 1, which nobody stored; chunk 3 names chunk 2
        res = index.reserve(1, NS, [ks[depth]], PAGE, depth, now=0.0, parent_key=ks[depth - 1])
        index.commit(1, res.reservation_id, [0])
    assert stored(pub) == []
    index.drop([ks[3]])  # leaves while waiting: never announced, nothing to remove
    store(index, ks[:2], toks[: 2 * CHUNK])  # the head: 0, 1, then 2 (waiting for 1)
    assert [e.block_hashes[0] for e in stored(pub)] == ks[:3]
    assert stored(pub)[2].parent_block_hash == ks[1] and removed_hashes(pub) == []


def test_a_parent_key_is_checked():
    index, _ = make()
    with pytest.raises(PoolError, match="starts past chunk 0"):
        index.reserve(1, NS, keys("p", 1), PAGE, 0, now=0.0, parent_key=keys("q", 1)[0])
    with pytest.raises(PoolError, match="16 bytes"):
        index.reserve(1, NS, keys("p", 1), PAGE, 1, now=0.0, parent_key=b"short")


def test_evictions_drops_and_flushes_announce_every_announced_page_removed():
    """Fails when the removal hook is taken out of PoolIndex._remove_committed."""
    index, pub = make(pages=8, high_watermark=1.0, low_watermark=1.0)
    first, second = keys("c", 6), keys("d", 4)
    store(index, first)
    store(index, second)  # 10 pages wanted in 8: the oldest of ``first`` are evicted for room
    announced = [e.block_hashes[0] for e in stored(pub)]
    live = [k for k in first + second if index.entry(k) is not None]
    evicted = [k for k in announced if k not in live]
    assert evicted and sorted(removed_hashes(pub)) == sorted(evicted)
    index.drop([live[0]])
    assert removed_hashes(pub)[-1] == live[0]
    index.flush()
    assert sorted(removed_hashes(pub)) == sorted(announced)
    assert len(set(removed_hashes(pub))) == len(removed_hashes(pub))  # each page once


def test_token_ids_that_do_not_split_over_the_keys_are_refused():
    index, _ = make()
    with pytest.raises(PoolError, match="token id bytes"):
        index.reserve(1, NS, keys("e", 2), PAGE, 0, now=0.0, tokens_le32=b"\0" * 12)


@pytest.mark.parametrize("encoding", E.ENCODINGS)
def test_batches_round_trip_in_both_encodings(encoding):
    events = [
        E.all_blocks_cleared(encoding),
        E.block_stored(encoding, [7], None, [1, 2], 2),
        E.block_removed(encoding, [7]),
    ]
    payload = E.encode_batch(E.EventBatch(ts=1.5, events=events, data_parallel_rank=0))
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 1.5 and len(raw[1]) == 3
    if encoding == "map":
        assert raw[1][1]["type"] == "BlockStored" and raw[1][1]["medium"] == "CPU"
    else:
        assert raw[1][1] == ["BlockStored", [7], None, [1, 2], 2, None, "CPU"]
    assert E.decode_batch(payload, encoding).events == events
    with pytest.raises(ValueError, match="not a"):
        E.decode_batch(b"\x01", encoding)


def test_hashes_are_the_keys_low_64_bits_by_default():
    key = bytes(range(16))
    assert E.external_hash(key, "int") == int.from_bytes(key[8:], "big")
    assert E.external_hash(key, "bytes") == key


def test_config_refuses_a_bad_endpoint_or_encoding():
    with pytest.raises(ValueError, match="endpoint"):
        KVEventsConfig(endpoint="localhost:5557")
    with pytest.raises(ValueError, match="encoding"):
        KVEventsConfig(endpoint="tcp://*:5557", encoding="json")
