"""A hybrid model's prefixes shared through the pool (kvshare.engine.pool_states, kvshare.engine.hybrid_resume):
replicas resume only from a state checkpoint with the KV of every chunk before it, never with KV beyond it, and every
output equals recomputing (float32 on CPU; bitwise in the deterministic mode)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.keys import state_key
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool

CHUNK = 64
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1)
COLD = RequestOptions(use_pool=False, use_local_cache=False)
NO_LOCAL = RequestOptions(use_local_cache=False)


@pytest.fixture(scope="module")
def pool():
    with running_pool("64MiB", ("--extent-size", "4MiB", "--high-watermark", "1", "--low-watermark", "1")) as path:
        yield path


def engine(pool: str, **config) -> Engine:
    fields = dict(model="qwen3.5-tiny", chunk_tokens=CHUNK, state_checkpoint_chunks=2, verify_checksums=True)
    return Engine(EngineConfig(pool_socket=pool, **(fields | config)))


@pytest.fixture(scope="module")
def pair(pool):
    """Replica A (writes) and replica B (reads), each with its own local cache."""
    a, b = engine(pool), engine(pool)
    yield a, b
    a.close()
    b.close()


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, ids: list[int], options: RequestOptions = NO_LOCAL):
    events = list(engine.generate(ids, PARAMS, options))
    return [e.token_id for e in events], [e.logprob for e in events], events[0].provenance


def assert_as_cold(engine: Engine, ids: list[int], tokens: list[int], logprobs: list[float]) -> None:
    """Tokens equal recomputing, and each logprob within float32's reach of it (a state off by a chunk is not)."""
    cold_tokens, cold_logprobs, _ = run(engine, ids, COLD)
    assert tokens == cold_tokens
    assert np.allclose(logprobs, cold_logprobs, atol=1e-4, rtol=0)


def checkpoints_held(pool: str, engine: Engine, ids: list[int]) -> list[int]:
    """The chunk counts j whose checkpoint the pool holds for this prompt."""
    keys = engine.prompt_chunk_keys(ids)
    size = engine.model.state.layout.checkpoint_bytes
    with PoolClient(pool) as client:
        return [j + 1 for j, key in enumerate(keys) if client.lookup([state_key(key)], size, lease=False).num_pages]


def test_a_replica_resumes_at_the_deepest_checkpoint_another_stored(pool, pair):
    a, b = pair
    prompt = ids_of(5 * CHUNK + 30, 1)
    run(a, prompt)
    assert checkpoints_held(pool, a, prompt) == [2, 4, 5]  # every 2 chunks and the last whole chunk
    tokens, logprobs, provenance = run(b, prompt)
    assert (provenance.pool_tokens, provenance.computed_tokens) == (5 * CHUNK, 30)
    assert b.stats().pool_states_loaded == 1
    state_bytes, page_bytes = b.model.state.layout.checkpoint_bytes, b.layout.page_bytes
    assert (provenance.pool_kv_bytes, provenance.pool_state_bytes) == (5 * page_bytes, state_bytes)
    assert_as_cold(b, prompt, tokens, logprobs)


def test_a_prompt_of_whole_chunks_resumes_elsewhere_one_chunk_before_its_end(pool, pair):
    """The state after the last whole chunk serves the next turn; the same prompt needs its last token computed, so
    the state one chunk earlier is kept too (a benchmark's prompts are whole chunks)."""
    a, b = pair
    prompt = ids_of(3 * CHUNK, 15)
    run(a, prompt)
    assert checkpoints_held(pool, a, prompt) == [2, 3]
    tokens, logprobs, provenance = run(b, prompt)
    assert_as_cold(b, prompt, tokens, logprobs)
    assert (provenance.pool_tokens, provenance.computed_tokens) == (2 * CHUNK, CHUNK)


def test_bytes_loaded_equal_bytes_stored(pool, pair):
    """The pool's page holds the writer's checkpoint, and the reader's state after the load is that page."""
    a, b = pair
    prompt = ids_of(2 * CHUNK + 10, 2)
    run(a, prompt, RequestOptions())  # into A's local cache too: the checkpoint A took
    keys = a.prompt_chunk_keys(prompt)
    taken = a._local.checkpoint(keys[1]).clone()
    size = a.model.state.layout.checkpoint_bytes
    with PoolClient(pool) as client:
        grant = client.lookup([state_key(keys[1])], size, lease=False)
        stored = torch.from_numpy(client.page(grant.pages[0].offset, size).copy())
    assert torch.equal(stored, taken)
    before = b.stats().pool_state_bytes_loaded
    loaded = []
    restore_position = b.hybrid._load

    def spy(kv, keys, resume):  # the state right after the load, before the forward moves it on
        load = restore_position(kv, keys, resume)
        loaded.append(b.model.state.buffer.clone())
        return load

    b.hybrid._load = spy
    try:
        run(b, prompt)
    finally:
        b.hybrid._load = restore_position
    assert torch.equal(loaded[0], stored) and b.stats().pool_state_bytes_loaded - before == size


def test_prompts_that_share_a_prefix_served_concurrently_on_two_replicas(pool, pair):
    a, b = pair
    shared = ids_of(3 * CHUNK, 3)
    prompts = [shared + ids_of(70, 4), shared + ids_of(90, 5)]
    results: dict[int, tuple] = {}

    def serve(i: int, replica: Engine) -> None:
        results[i] = run(replica, prompts[i])

    threads = [threading.Thread(target=serve, args=(i, r)) for i, r in enumerate((a, b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, replica in enumerate((a, b)):
        tokens, logprobs, _ = results[i]
        assert_as_cold(replica, prompts[i], tokens, logprobs)
    for i, replica in enumerate((b, a)):  # each replica then reads what the other stored
        tokens, logprobs, provenance = run(replica, prompts[i])
        assert provenance.pool_tokens >= 2 * CHUNK
        assert_as_cold(replica, prompts[i], tokens, logprobs)


def test_a_checkpoint_shallower_than_the_run_of_kv_pages(pool, pair):
    """KV pages of 5 chunks, a checkpoint after 2 only: the resume is at 2, the pages past it unused."""
    a, b = pair
    prompt = ids_of(5 * CHUNK + 20, 6)
    run(a, prompt)
    keys = a.prompt_chunk_keys(prompt)
    with PoolClient(pool) as client:
        assert client.drop([state_key(keys[3]), state_key(keys[4])]) == 2
    tokens, logprobs, provenance = run(b, prompt)
    assert_as_cold(b, prompt, tokens, logprobs)
    assert (provenance.pool_tokens, provenance.computed_tokens) == (2 * CHUNK, 3 * CHUNK + 20)


def test_a_replica_whose_own_prefix_is_longer_than_the_pools_checkpoint(pool, pair):
    """B holds the prompt's 5 chunks of KV locally but no state past chunk 0; the pool's deepest checkpoint is after
    2 chunks: B resumes there with its own KV of chunks 1..2 and computes the rest, never its KV past 2 with it."""
    a, b = pair
    prompt = ids_of(5 * CHUNK + 40, 7)
    run(a, prompt)
    keys = a.prompt_chunk_keys(prompt)
    with PoolClient(pool) as client:
        client.drop([state_key(keys[3]), state_key(keys[4])])
    run(b, prompt, RequestOptions(use_pool=False))  # B's own: every chunk and its checkpoints
    for j in (2, 4, 5):  # B's local states go, its KV chunks stay
        b._local._remove(state_key(keys[j - 1]))
        b._local._checkpoint_keys.discard(state_key(keys[j - 1]))
    run(b, ids_of(100, 8))  # the sequence KV no longer holds the prompt
    tokens, logprobs, provenance = run(b, prompt, RequestOptions())
    assert_as_cold(b, prompt, tokens, logprobs)
    reused = (provenance.local_tokens, provenance.pool_tokens, provenance.computed_tokens)
    assert reused == (2 * CHUNK, 0, 3 * CHUNK + 40)  # the pool's state at 2, B's own KV before it


def test_a_checkpoint_evicted_while_its_kv_pages_stay_and_the_reverse(pool, pair):
    a, b = pair
    prompt = ids_of(4 * CHUNK + 10, 9)
    run(a, prompt)
    keys = a.prompt_chunk_keys(prompt)
    with PoolClient(pool) as client:
        client.drop([state_key(keys[3])])  # the deepest checkpoint goes; its KV pages stay
    tokens, logprobs, provenance = run(b, prompt)
    assert_as_cold(b, prompt, tokens, logprobs)
    assert (provenance.pool_tokens, provenance.computed_tokens) == (2 * CHUNK, 2 * CHUNK + 10)
    other = ids_of(4 * CHUNK + 10, 10)
    run(a, other)
    keys = a.prompt_chunk_keys(other)
    with PoolClient(pool) as client:
        client.drop([keys[0]])  # the run's first KV page goes; every checkpoint stays, none is reachable
    tokens, logprobs, provenance = run(b, other)
    assert_as_cold(b, other, tokens, logprobs)
    assert (provenance.pool_tokens, provenance.computed_tokens) == (0, len(other))


def test_a_corrupted_checkpoint_is_caught_recomputed_counted_and_dropped(pool, pair):
    a, b = pair
    prompt = ids_of(4 * CHUNK + 25, 11)
    run(a, prompt)
    keys = a.prompt_chunk_keys(prompt)
    size = a.model.state.layout.checkpoint_bytes
    with PoolClient(pool) as client:
        page = client.lookup([state_key(keys[3])], size, lease=False).pages[0]
        client.page(page.offset, size)[1000] ^= 0x40  # a flipped bit in the recurrent state after 4 chunks
    failures = b.stats().checksum_failures
    tokens, logprobs, provenance = run(b, prompt)
    assert b.stats().checksum_failures == failures + 1
    assert_as_cold(b, prompt, tokens, logprobs)
    assert (provenance.pool_tokens, provenance.computed_tokens) == (2 * CHUNK, 2 * CHUNK + 25)  # the next shallower
    failures = a.stats().checksum_failures  # the bad page was dropped; B stored the state it recomputed in its place
    tokens, logprobs, provenance = run(a, prompt)
    assert provenance.pool_tokens == 4 * CHUNK and a.stats().checksum_failures == failures
    assert_as_cold(a, prompt, tokens, logprobs)


def test_another_state_layout_shares_nothing(pool, pair):
    a, _ = pair
    prompt = ids_of(3 * CHUNK + 5, 12)
    run(a, prompt)
    other = engine(pool)
    try:
        other.namespace = dataclasses.replace(other.namespace, state_layout_id="another-layout")
        other._digests.clear()
        tokens, logprobs, provenance = run(other, prompt)
        assert provenance.pool_tokens == 0 and other.stats().pool_states_loaded == 0
        assert_as_cold(other, prompt, tokens, logprobs)
    finally:
        other.close()


def test_deterministic_mode_pool_on_equals_pool_off_bitwise(pool):
    a, b = engine(pool, deterministic=True), engine(pool, deterministic=True)
    try:
        prompt = ids_of(4 * CHUNK + 33, 13)
        run(a, prompt)
        tokens, logprobs, provenance = run(b, prompt)
        assert provenance.pool_tokens == 4 * CHUNK and provenance.is_deterministic
        off_tokens, off_logprobs, _ = run(b, prompt, COLD)
        assert tokens == off_tokens and logprobs == off_logprobs  # bit for bit
    finally:
        a.close()
        b.close()


def test_the_pool_stats_count_checkpoints_and_their_bytes(pool, pair):
    a, _ = pair
    run(a, ids_of(2 * CHUNK + 1, 14))
    with PoolClient(pool) as client:
        stats = client.stats()
    size = a.model.state.layout.checkpoint_bytes
    assert stats["checkpoints"] > 0 and stats["checkpoint_bytes"] == stats["checkpoints"] * size


def test_a_cross_replica_resume_fills_the_load_steps_of_its_timeline(pair):
    """The hybrid's prefill marks the lease, the load and its check as the dense one does (a GPU row's timeline
    says where a cross-replica request's time went)."""
    from kvshare.engine.timeline import Timeline

    a, b = pair
    prompt = ids_of(4 * CHUNK + 20, 61)
    run(a, prompt)
    timeline = Timeline(arrival_s=0.0)
    tokens, logprobs, provenance = run(b, prompt, dataclasses.replace(NO_LOCAL, timeline=timeline))
    assert provenance.pool_state_bytes > 0
    steps = timeline.as_dict()
    order = ["hashing", "lookup_and_lease", "load_issued", "load_end", "forward_end", "load_checked"]
    assert all(steps[s] is not None for s in order), steps
    assert [steps[s] for s in order] == sorted(steps[s] for s in order)
    assert_as_cold(b, prompt, tokens, logprobs)
