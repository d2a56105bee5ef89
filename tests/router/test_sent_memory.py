"""pool_aware's memory of what each replica was sent, credited only as deep as the replica keeps it."""

import json
from types import SimpleNamespace

import pytest

from kvshare.router.chunk_chain import chain
from kvshare.router.cost_model import CostModel
from kvshare.router.policy import ReplicaView, RouteFacts, Router
from kvshare.router.pool_aware import PoolAwarePlacer
from kvshare.router.sent_memory import SentMemory, fit_capacity
from tests.router.test_pool_aware import FakeFeed

CHUNK = 256  # the placer's chunk size with no pool event seen (kvshare.keys.DEFAULT_CHUNK_TOKENS)
GPU_ONLY = CostModel(
    kv_bytes_per_token=1000,
    load_bytes_per_s=1e7,
    prefill_tokens_per_s=1000,
    queue_s_per_request=0.1,
    use_pool_term=False,
)


def prompt(first: int, num_chunks: int) -> list[int]:
    return list(range(first, first + num_chunks * CHUNK))


def hashes(ids) -> list[bytes]:
    return chain(ids, CHUNK, None)


def test_the_capacity_separates_the_depths_a_replica_kept_from_those_it_lost():
    assert fit_capacity([(0, True), (3, True)]) is None  # nothing lost yet: no limit
    assert fit_capacity([(0, True), (3, True), (5, False), (9, False)]) == 5
    assert fit_capacity([(1, True), (2, False), (2, True), (6, False)]) == 6  # one report on the wrong side either way
    assert fit_capacity([(0, False)]) == 0


def test_depth_counts_the_new_chunks_sent_since_a_chunk_was_last_used():
    memory = SentMemory(1)
    a = hashes(prompt(0, 2))
    memory.remember(0, a)
    assert memory.depths(0, a) == [0, 1]  # the head the most recently used, as the replica inserts
    memory.remember(0, hashes(prompt(10_000, 3)))
    assert memory.depths(0, a) == [3, 4]
    memory.remember(0, a)  # used again: nothing new was sent since
    assert memory.depths(0, a) == [0, 0]


def test_a_prefix_pushed_deeper_than_the_replica_keeps_is_not_credited():
    """Fails when held_tokens credits every chunk ever sent (the capacity is ignored)."""
    memory = SentMemory(1)
    a = hashes(prompt(0, 2))
    memory.remember(0, a)
    assert memory.held_tokens(0, a, CHUNK) == 2 * CHUNK  # no loss reported: everything sent is credited
    for k in range(3):
        memory.remember(0, hashes(prompt(10_000 * (k + 1), 2)))
    # a response: the replica held the first chunk of a prompt sent at depth 2 and had lost its second (depth 3)
    b = hashes(prompt(90_000, 2))
    memory.report(0, [2, 3], 1)
    assert memory.capacity[0] == 3
    assert memory.depths(0, a) == [6, 7] and memory.held_tokens(0, a, CHUNK) == 0
    shallow = hashes(prompt(30_000, 2))  # the last prompt sent: depths 0 and 1
    assert memory.held_tokens(0, shallow, CHUNK) == 2 * CHUNK
    assert memory.held_tokens(0, b, CHUNK) == 0  # never sent


def queued_behind(router: Router, conversation, num_others: int) -> None:
    """``conversation`` placed on replica 0, then ``num_others`` other 2-chunk prompts placed there too."""
    placer = router.pool_aware
    placer.sent.remember(0, hashes(conversation))
    for k in range(num_others):
        placer.sent.remember(0, hashes(prompt(100_000 * (k + 1), 2)))


def test_a_conversation_goes_back_to_the_replica_that_holds_it_until_the_others_pushed_it_out():
    """GPU-only terms: replica 0 was sent the conversation's first turn, then three other prompts; it reported
    keeping chunks only to depth 3. The next turn is computed in full on either replica, so the turn (replica 1)
    decides. Fails when the sent memory credits replica 0 with a prefix its cache no longer holds."""
    conversation = prompt(0, 2)
    facts = RouteFacts(prompt_ids=conversation + list(range(5000, 5000 + CHUNK)))
    idle = [ReplicaView(0, True, 0), ReplicaView(1, True, 0)]

    router = Router("pool_aware", 2, pool_aware=PoolAwarePlacer(2, GPU_ONLY, FakeFeed([])))
    queued_behind(router, conversation, 3)
    router._next = 1
    assert router.choose(facts, idle, now=0.0)[0] == 0  # nothing reported lost: the prefix is credited

    router = Router("pool_aware", 2, pool_aware=PoolAwarePlacer(2, GPU_ONLY, FakeFeed([])))
    queued_behind(router, conversation, 3)
    router.pool_aware.sent.report(0, [0, 1, 2, 3], 3)
    router._next = 1
    assert router.choose(facts, idle, now=0.0)[0] == 1


def test_a_relayed_response_reports_what_its_replica_held_to_the_sent_memory():
    """The placer's timing hands the response's local_tokens to the sent memory. Fails when the relay's
    measurement does not report them (the capacity is never learned)."""
    placer = PoolAwarePlacer(2, GPU_ONLY, FakeFeed([]))
    sent = prompt(0, 4)
    placer.sent.remember(1, hashes(sent))
    placer.order(sent, None, [0, 0], [True, False], 0, now=0.0)  # replica 0 unavailable: replica 1 it is
    placement = placer.last_placement
    assert placement.depths[1] == [0, 1, 2, 3]
    upstream = SimpleNamespace(content_type="application/json")
    timing = placer.timing(1, 0.0, upstream, placement)
    body = {"choices": [], "kvshare": {"local_tokens": 2 * CHUNK + 10, "pool_tokens": 0, "computed_tokens": 500}}
    timing.piece(json.dumps(body).encode(), 0.5)
    timing.end(0.6)
    assert placer.sent.capacity[1] == 2  # held chunks at depths 0 and 1, lost the one at depth 2
    assert placer.sent.capacity[0] is None


@pytest.mark.parametrize("local_tokens", [None, -1])
def test_a_response_without_a_usable_local_count_reports_nothing(local_tokens):
    placer = PoolAwarePlacer(2, GPU_ONLY, FakeFeed([]))
    placer.order(prompt(0, 2), None, [0, 0], [True, True], 0, now=0.0)
    timing = placer.timing(0, 0.0, SimpleNamespace(content_type="application/json"), placer.last_placement)
    body = {"choices": [], "kvshare": {"local_tokens": local_tokens, "pool_tokens": 0, "computed_tokens": 5}}
    timing.piece(json.dumps(body).encode(), 0.5)
    timing.end(0.6)
    assert placer.sent.capacity == [None, None]
