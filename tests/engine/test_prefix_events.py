"""The local prefix cache's KV events: announced head first, only while held, parents before children,
removals announced; end to end through ZMQ, read by the subscriber the pool's event tests use and indexed
the way pool_aware's GPU term reads a replica."""

from __future__ import annotations

import time

import pytest
import torch

from kvshare.engine.prefix_cache import LocalPrefixCache
from kvshare.engine.prefix_events import PrefixCacheEvents
from kvshare.pool import events as E

CHUNK_BYTES = 4 * 4  # a [4] float32 tensor stands in for a chunk


class ListPublisher:
    def __init__(self):
        self.events = []

    def put(self, event):
        self.events.append(event)

    def close(self):
        pass


def cache_with_events(capacity_chunks):
    cache = LocalPrefixCache(capacity_chunks * CHUNK_BYTES)
    publisher = ListPublisher()
    cache.listener = PrefixCacheEvents(publisher, block_size=2)
    return cache, publisher.events


def offer(cache, keys, ids):
    """As the engine publishes a prompt (chunks of 2 tokens)."""
    cache.insert_prompt(keys, lambda i: torch.full((4,), float(i)), ids)


def h(key):
    return E.external_hash(key, "int")


def test_a_prompt_is_announced_head_first_with_its_tokens_and_each_eviction_is_announced():
    """Fails when an eviction of the local cache is not announced (the router would go on crediting the replica
    with a prefix it no longer holds)."""
    cache, events = cache_with_events(3)
    keys = [b"a0", b"a1", b"a2"]
    offer(cache, keys, [1, 2, 3, 4, 5, 6])
    assert isinstance(events[0], E.AllBlocksCleared)
    stored = events[1:]
    assert [e.block_hashes for e in stored] == [[h(k)] for k in keys]
    assert [e.parent_block_hash for e in stored] == [None, h(b"a0"), h(b"a1")]
    assert [e.token_ids for e in stored] == [[1, 2], [3, 4], [5, 6]]
    assert {e.medium for e in stored} == {E.MEDIUM_GPU} and {e.block_size for e in stored} == {2}
    offer(cache, keys, [1, 2, 3, 4, 5, 6])  # held already: announced once
    assert len(events) == 4
    cache.insert(b"b0", torch.zeros(4))  # full: the LRU chunk (the chain's tail) goes
    assert isinstance(events[-1], E.BlockRemoved) and events[-1].block_hashes == [h(b"a2")]
    assert events[-1].medium == E.MEDIUM_GPU
    cache.discard([b"a0"])
    assert events[-1].block_hashes == [h(b"a0")]
    cache.clear()
    assert isinstance(events[-1], E.AllBlocksCleared)


def test_a_chunk_not_held_is_not_announced_nor_its_children_and_a_salted_one_has_no_tokens():
    cache, events = cache_with_events(2)
    offer(cache, [b"c0", b"c1", b"c2"], [1, 2, 3, 4, 5, 6])  # room for 2: c2 (the tail) did not stay
    assert [e.block_hashes for e in events[1:]] == [[h(b"c0")], [h(b"c1")]]
    cache2, events2 = cache_with_events(4)
    cache2.insert(b"x1", torch.zeros(4))
    cache2.listener.stored([b"x0", b"x1"], [1, 2, 3, 4], cache2.__contains__)  # its parent is not held
    assert len(events2) == 1
    offer(cache2, [b"s0"], None)  # a tenant's chunk: no token ids, the block size still said
    assert events2[-1].token_ids == [] and events2[-1].block_size == 2


@pytest.mark.timeout(120)
def test_an_engine_publishes_its_prompt_and_the_router_index_reads_it(tiny_dir, tmp_path):
    """A real engine's prompt, over ZMQ (vLLM's example subscriber, sequence continuity checked), indexed by
    pool_aware's replica index: the prompt's full chunks are credited to that replica's GPU."""
    pytest.importorskip("zmq")
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
    from kvshare.pool.event_publisher import KVEventsConfig
    from kvshare.router.prefix_index import PoolPrefixIndex
    from tests.engine.conftest import ascii_prompt
    from tests.pool.test_events_wire import BlockStored, Subscriber

    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rep"
    config = KVEventsConfig(endpoint=endpoint, replay_endpoint=replay, topics=("kv@replica0@tiny",), block_size=16)
    subscriber = Subscriber(endpoint, replay, "kv@replica0@tiny")
    engine = Engine(EngineConfig(model=tiny_dir, chunk_tokens=16, kv_events=config))
    ids = engine.tokenizer.encode(ascii_prompt(40, seed=3))  # 2 full chunks and 8 tokens
    try:
        # a subscriber that joined after a batch went out learns of it from the next batch's sequence (a gap,
        # filled by replay): later prompts make those batches
        for seed in range(3, 9):
            prompt = ids if seed == 3 else engine.tokenizer.encode(ascii_prompt(20, seed=seed))
            list(engine.generate(prompt, SamplingParams(max_tokens=2), RequestOptions(use_pool=False)))
            deadline = time.monotonic() + 3
            while sum(isinstance(e, BlockStored) for e in subscriber.events) < 2 and time.monotonic() < deadline:
                subscriber.poll(100)
    finally:
        engine.close()
        subscriber.close()
    stored = [e for e in subscriber.events if isinstance(e, BlockStored)][:2]  # the first prompt's, in order
    assert [list(e.token_ids) for e in stored] == [list(ids[:16]), list(ids[16:32])]
    assert {e.medium for e in stored} == {"GPU"} and stored[1].parent_block_hash == stored[0].block_hashes[0]
    index = PoolPrefixIndex(media=(E.MEDIUM_GPU, None))
    for event in stored:
        index.apply(
            E.block_stored(
                "map",
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                event.block_size,
                medium=event.medium,
            )
        )
    assert index.held_tokens(list(ids), None) == 32
