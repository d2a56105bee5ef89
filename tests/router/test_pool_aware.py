"""pool_aware: the index kept from the pool's KV events, T_r, the ranking, the fallback (no process, no socket)."""

import dataclasses
import logging
import time

import pytest

from kvshare.pool import events as E
from kvshare.router.chunk_chain import chain
from kvshare.router.cost_model import CostModel, expected_ttft, rank
from kvshare.router.kv_event_feed import KVEventFeed
from kvshare.router.policy import ReplicaView, RouteFacts, Router
from kvshare.router.pool_aware import PoolAwarePlacer
from kvshare.router.prefix_index import PoolPrefixIndex

CHUNK = 4
COST = CostModel(kv_bytes_per_token=1000, load_bytes_per_s=1e6, prefill_tokens_per_s=1000, queue_s_per_request=0.1)


def stored_chain(ids, first_hash=100, parent=None):
    """BlockStored events of ``ids``'s full chunks, one per chunk, each naming the one before."""
    events = []
    for i in range(len(ids) // CHUNK):
        block = first_hash + i
        events.append(E.block_stored("map", [block], parent, ids[i * CHUNK : (i + 1) * CHUNK], CHUNK))
        parent = block
    return events


def index_of(events):
    index = PoolPrefixIndex()
    for event in events:
        index.apply(event)
    return index


def test_the_index_matches_a_prompt_by_its_tokens_and_forgets_what_is_removed():
    prompt = list(range(16))
    index = index_of(stored_chain(prompt[:12]))
    assert index.held_tokens(prompt, None) == 12
    assert index.held_tokens([99] + prompt[1:], None) == 0  # another first chunk: nothing
    index.apply(E.block_removed("map", [101]))  # the second chunk is evicted: the prefix ends at the first
    assert index.held_tokens(prompt, None) == 4
    index.apply(E.all_blocks_cleared("map"))
    assert index.held_tokens(prompt, None) == 0


def test_a_salted_prompt_never_matches_what_the_pool_announced():
    """Tenants never see each other's prefixes: fails when held_tokens ignores the salt."""
    prompt = list(range(8))
    index = index_of(stored_chain(prompt))
    assert index.held_tokens(prompt, None) == 8
    assert index.held_tokens(prompt, "tenant-a") == 0


def test_a_page_without_tokens_or_with_an_unknown_parent_is_not_indexed():
    index = index_of(
        [
            E.block_stored("map", [1], None, [], CHUNK),  # salted page: no token ids
            E.block_stored("map", [2], 77, [4, 5, 6, 7], CHUNK),
        ]
    )  # parent never announced
    assert len(index) == 0


def test_t_r_adds_queue_load_of_what_only_the_pool_holds_and_prefill_of_the_rest():
    # 1000 tokens, 400 on the GPU, 800 in the pool, 2 in flight: 0.2 + 400 * 1000 / 1e6 + 200 / 1000
    assert expected_ttft(COST, 1000, 400, 800, 2) == pytest.approx(0.2 + 0.4 + 0.2)
    assert expected_ttft(COST, 1000, 800, 400, 0) == pytest.approx(0.2)  # the GPU holds more: no load


def test_a_replica_that_loads_from_the_pool_beats_one_that_recomputes_half():
    """The pool term is what ranks: fails when expected_ttft leaves out the pool's tokens (then replica 0, which
    holds half on its GPU, looks faster than recomputing everything on replica 1)."""
    cost = CostModel(kv_bytes_per_token=1000, load_bytes_per_s=1e7, prefill_tokens_per_s=1000, queue_s_per_request=0.1)
    times = [expected_ttft(cost, 1000, 500, 1000, 1), expected_ttft(cost, 1000, 0, 1000, 0)]
    assert times == [pytest.approx(0.15), pytest.approx(0.1)]
    assert rank(times, [True, True], 0) == [1, 0]
    assert rank([1.0, 0.5], [True, False], 0) == [0, 1]  # an unavailable replica goes last


class FakeFeed(KVEventFeed):
    def __init__(self, events):
        super().__init__("ipc:///unused", "kv@")
        for event in events:
            self.index.apply(event)
        self.last_seq = 0


def placer_with(events, num_replicas=2):
    router = Router("pool_aware", num_replicas, pool_aware=PoolAwarePlacer(num_replicas, COST, FakeFeed(events)))
    return router


def views(*in_flight):
    return [ReplicaView(i, True, q) for i, q in enumerate(in_flight)]


def test_the_router_sends_a_prompt_the_pool_holds_to_the_idle_replica_and_remembers_it():
    prompt = list(range(4000, 4000 + 256))
    router = placer_with(stored_chain(prompt))
    facts = RouteFacts(prompt_ids=prompt)
    assert router.choose(facts, views(2, 0), now=0.0)[0] == 1
    # replica 1 now holds it on its GPU: with one in flight there (0.1 s) it still beats a load (0.256 s)
    assert router.choose(facts, views(0, 1), now=0.0)[0] == 1
    assert router.choose(facts, views(0, 3), now=0.0)[0] == 0  # three in flight (0.3 s): the load wins


def test_events_that_are_not_live_fall_back_to_round_robin_counted_and_come_back():
    """Fails when the placer places on a stale index instead of falling back."""
    prompt = list(range(64))
    router = placer_with(stored_chain(prompt))
    feed = router.pool_aware.feed
    feed.lag_s = 60.0
    first = [router.choose(RouteFacts(prompt_ids=prompt), views(0, 0), now=0.0)[0] for _ in range(4)]
    assert first == [0, 1, 0, 1] and router.pool_aware.num_fallbacks == 4
    assert "lag" in router.pool_aware.fallback_reason
    feed.lag_s = 0.0
    router.choose(RouteFacts(prompt_ids=prompt), views(0, 0), now=0.0)
    assert router.pool_aware.fallback_reason is None and router.pool_aware.num_fallbacks == 4


def test_silence_after_prompts_the_pool_did_not_hold_means_the_events_stopped():
    router = placer_with([])
    feed = router.pool_aware.feed
    router.choose(RouteFacts(prompt_ids=list(range(512))), views(0, 0), now=100.0)  # new chunks: expected
    assert feed.why_not_live(100.0 + feed.max_silence_s / 2) is None
    assert "no KV events" in feed.why_not_live(100.0 + feed.max_silence_s + 1)


def test_an_outage_is_logged_once_however_long_it_lasts(caplog):
    """Fails when the reason names the seconds so far (each request of the outage logged a warning)."""
    router = placer_with([])
    feed = router.pool_aware.feed
    router.choose(RouteFacts(prompt_ids=list(range(512))), views(0, 0), now=100.0)
    with caplog.at_level(logging.WARNING, logger="kvshare.router.pool_aware"):
        for k in range(5):
            now = 100.0 + feed.max_silence_s + 1 + k
            router.choose(RouteFacts(prompt_ids=list(range(512))), views(0, 0), now=now)
    assert router.pool_aware.num_fallbacks == 5
    assert sum("falling back to round robin" in r.getMessage() for r in caplog.records) == 1


def test_a_feed_that_never_received_is_not_live():
    feed = KVEventFeed("ipc:///unused", "kv@")
    assert "no KV events received" in feed.why_not_live(time.monotonic())


def test_chain_is_seeded_by_the_salt():
    assert chain(list(range(8)), CHUNK, None) != chain(list(range(8)), CHUNK, "s")
    assert len(chain(list(range(9)), CHUNK, None)) == 2  # full chunks only


def test_a_block_hashed_with_more_than_its_tokens_is_not_indexed():
    """vLLM puts a cache_salt, a LoRA or media in extra_keys: tokens alone must not match such a block.
    Fails when PoolPrefixIndex.apply indexes keyed blocks."""
    index = PoolPrefixIndex(media=(E.MEDIUM_GPU, None))
    keyed = E.BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[0, 1, 2, 3],
        block_size=CHUNK,
        lora_id=None,
        medium=E.MEDIUM_GPU,
        lora_name=None,
        extra_keys=[("tenant-a",)],
    )
    lora = E.BlockStored(
        block_hashes=[2],
        parent_block_hash=None,
        token_ids=[0, 1, 2, 3],
        block_size=CHUNK,
        lora_id=None,
        medium=E.MEDIUM_GPU,
        lora_name="adapter",
    )
    plain = E.BlockStored(
        block_hashes=[3],
        parent_block_hash=None,
        token_ids=[0, 1, 2, 3],
        block_size=CHUNK,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    for event in (keyed, lora):
        index.apply(event)
    assert len(index) == 0
    index.apply(plain)  # older vLLM sends no medium: a replica's own block
    assert index.held_tokens([0, 1, 2, 3], None) == CHUNK
    assert PoolPrefixIndex().held_tokens([0, 1, 2, 3], None) == 0  # the pool's index takes CPU blocks only


def test_a_replica_that_publishes_its_gpu_blocks_is_credited_from_them():
    """Fails when the placer ignores a replica's own events (it never sent replica 1 this prompt)."""
    prompt = list(range(256))
    router = placer_with(stored_chain(prompt))
    gpu = FakeFeed([])
    gpu.index.media = (E.MEDIUM_GPU,)
    gpu.index.apply(
        E.BlockStored(
            block_hashes=[9],
            parent_block_hash=None,
            token_ids=prompt,
            block_size=256,
            lora_id=None,
            medium=E.MEDIUM_GPU,
            lora_name=None,
        )
    )
    router.pool_aware.replica_feeds = [FakeFeed([]), gpu]
    # replica 0 is idle but must load 256 tokens (0.256 s); replica 1 holds them on its GPU: 2 in flight (0.2 s)
    assert router.choose(RouteFacts(prompt_ids=prompt), views(0, 2), now=0.0)[0] == 1


def test_the_gpu_only_variant_leaves_the_pool_out_of_t_r():
    """Without the pool term a prefix only the pool holds is prefill, so the busy replica holding half of it on
    its GPU wins where the full policy sends the prompt to the idle replica that loads it. Fails when
    expected_ttft ignores use_pool_term."""
    full = CostModel(kv_bytes_per_token=1000, load_bytes_per_s=1e7, prefill_tokens_per_s=1000, queue_s_per_request=0.1)
    gpu_only = dataclasses.replace(full, use_pool_term=False)
    assert expected_ttft(gpu_only, 1000, 500, 1000, 1) == pytest.approx(0.1 + 0.5)
    assert expected_ttft(gpu_only, 1000, 0, 1000, 0) == pytest.approx(1.0)
    prompt = list(range(4000, 4000 + 256))
    chosen = {}
    for name, cost in (("full", full), ("gpu_only", gpu_only)):
        router = Router("pool_aware", 2, pool_aware=PoolAwarePlacer(2, cost, FakeFeed(stored_chain(prompt))))
        router.pool_aware.sent.remember(0, chain(prompt, CHUNK, None)[:32])  # replica 0 was sent half of it
        chosen[name] = router.choose(RouteFacts(prompt_ids=prompt), views(1, 0), now=0.0)[0]
    # full: 0.1 + 128 tokens loaded (0.0128 s) on replica 0 vs 256 loaded (0.0256 s) on replica 1
    # GPU-only: 0.1 + 128 tokens of prefill (0.128 s) on replica 0 vs 256 of prefill (0.256 s) on replica 1
    assert chosen == {"full": 1, "gpu_only": 0}
