"""A hybrid model's local reuse equals recomputing: it resumes only where it holds a GDN state, with the KV of every
token before it, and never combines a state with KV beyond it (kvshare.engine.hybrid_prefill)."""

from __future__ import annotations

import logging

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.engine.prefix_cache import LocalPrefixCache
from kvshare.keys import state_key

CHUNK = 64
NO_LOCAL = RequestOptions(use_local_cache=False)
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(model="qwen3.5-tiny", chunk_tokens=CHUNK, state_checkpoint_chunks=2))
    yield engine
    engine.close()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine: Engine, ids: list[int], options: RequestOptions = RequestOptions()):
    events = list(engine.generate(ids, PARAMS, options))
    return [e.token_id for e in events], events[0].provenance


def _cold(engine: Engine, ids: list[int]) -> list[int]:
    return run(engine, ids, NO_LOCAL)[0]


def test_the_same_prompt_again_computes_its_last_token_alone(engine):
    prompt = _ids(300, 1)
    first, _ = run(engine, prompt)
    again, provenance = run(engine, prompt)  # from the state after the prompt's first 299 tokens, KV in place
    assert (provenance.local_tokens, provenance.computed_tokens) == (299, 1)
    assert again == first == _cold(engine, prompt)


def test_a_next_turn_resumes_from_the_live_state_at_the_end_of_the_answer(engine):
    prompt = _ids(250, 2)
    answer, _ = run(engine, prompt)
    turn = prompt + answer[:-1] + [10, 20, 30]  # the answer's fed tokens are in the KV, and in the state
    got, provenance = run(engine, turn)
    assert (provenance.local_tokens, provenance.computed_tokens) == (250 + 5, 3)
    assert got == _cold(engine, turn)


def test_held_kv_longer_than_the_deepest_state_is_not_combined_with_it(engine):
    """The sequence KV holds the last prompt's first 250 tokens, but the deepest state the engine holds within
    them is the local cache's checkpoint at 2 chunks (128): it resumes there and computes 128.. again."""
    prompt = _ids(300, 3)
    run(engine, prompt)  # checkpoints at chunks 2 and 4 (every 2 chunks and the last whole chunk), prompt end 299
    branch = prompt[:250] + _ids(40, 4)
    got, provenance = run(engine, branch)
    assert (provenance.local_tokens, provenance.computed_tokens) == (128, 162)
    assert got == _cold(engine, branch)


def test_a_prompt_that_shares_whole_chunks_resumes_at_the_deepest_checkpoint_held(engine):
    first = _ids(330, 5)
    run(engine, first)  # the last whole chunk: 5 chunks (320); every 2 chunks: 128, 256
    run(engine, _ids(100, 6))  # another request in between: the sequence KV no longer holds the first
    second = first[:300] + _ids(50, 7)
    got, provenance = run(engine, second)
    assert provenance.local_tokens == 256  # not 300 (no state there), not 320 (past the shared tokens)
    assert got == _cold(engine, second)


def test_a_prompt_of_whole_chunks_keeps_its_last_chunks_state_for_the_next(engine):
    first = _ids(4 * CHUNK, 8)
    run(engine, first)
    run(engine, _ids(90, 9))
    longer = first + _ids(70, 10)
    got, provenance = run(engine, longer)
    assert provenance.local_tokens == 4 * CHUNK
    assert got == _cold(engine, longer)


def test_a_last_token_computed_by_the_decode_step_keeps_the_chunks_state():
    """On CUDA a prefill of one token runs the decode step (graphs); the state after it is the prompt's, and a
    checkpoint at its end (a prompt of whole chunks) is filled from it. Here the eager step stands in."""
    engine = Engine(EngineConfig(model="qwen3.5-tiny", chunk_tokens=CHUNK))
    try:
        engine.hybrid.decode_step = engine._decode_step
        prompt = _ids(4 * CHUNK, 13)
        run(engine, prompt)
        last_chunk = state_key(engine.prompt_chunk_keys(prompt)[-1])
        engine._local._remove(last_chunk)  # the checkpoint at 256 evicted: the next prefill takes it again
        engine._local._checkpoint_keys.discard(last_chunk)
        again, provenance = run(engine, prompt)  # from the state after 255 tokens: the last one by the step
        assert provenance.computed_tokens == 1 and again == _cold(engine, prompt)
        assert last_chunk in engine._local
        run(engine, _ids(70, 14))
        longer = prompt + _ids(30, 15)
        got, provenance = run(engine, longer)  # the checkpoint at 256 that the step's state filled
        assert provenance.local_tokens == 4 * CHUNK and got == _cold(engine, longer)
    finally:
        engine.close()


def test_the_pool_is_not_used_for_a_hybrid_model_and_says_so(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="kvshare.engine.engine"):
        engine = Engine(EngineConfig(model="qwen3.5-tiny", pool_socket=str(tmp_path / "no-pool.sock")))
    try:
        assert engine._pool is None and not engine.stats().is_pool_configured
        assert "the pool is not used for qwen3.5-tiny" in caplog.text
        tokens, provenance = run(engine, _ids(80, 11))
        assert len(tokens) == PARAMS.max_tokens and provenance.pool_tokens == 0
    finally:
        engine.close()


def test_dropped_chunks_take_their_checkpoints_and_the_prompt_end_with_them(engine):
    prompt = _ids(200, 12)
    run(engine, prompt)
    keys = engine.prompt_chunk_keys(prompt)
    assert state_key(keys[2]) in engine._local  # the last whole chunk's state
    engine.drop_chunks(keys)
    assert state_key(keys[2]) not in engine._local
    _tokens, provenance = run(engine, prompt)
    assert provenance.local_tokens == 0


# -- the local cache's lookup for a hybrid (kvshare.engine.prefix_cache) ---------------------------------------


def _cache_with(chunks: list[bytes], states: list[bytes], capacity: int = 1 << 20) -> LocalPrefixCache:
    cache = LocalPrefixCache(capacity)
    for i, key in reversed(list(enumerate(chunks))):
        cache.insert(key, torch.full((4,), float(i)))
    for key in states:
        cache.insert_checkpoint(key, torch.full((2,), float(chunks.index(key))))
    return cache


def test_the_lookup_ends_at_the_deepest_checkpoint_with_every_chunk_before_it():
    keys = [b"k0", b"k1", b"k2", b"k3"]
    cache = _cache_with(keys, [keys[0], keys[2]])
    used, chunks, state = cache.longest_resumable(keys)
    assert used == 3 and [float(c[0]) for c in chunks] == [0.0, 1.0, 2.0] and float(state[0]) == 2.0  # k3: no state
    used, chunks, state = cache.longest_resumable(keys, first=2)  # chunks 0 and 1 held elsewhere (in place)
    assert used == 3 and [float(c[0]) for c in chunks] == [2.0]
    cache.discard([keys[1]])  # a chunk before the deepest checkpoint is gone: the one before it is used
    used, chunks, state = cache.longest_resumable(keys)
    assert used == 1 and len(chunks) == 1 and float(state[0]) == 0.0
    used, chunks, state = cache.longest_resumable(keys, first=2)  # k1 is gone, but held in place: k2's state serves
    assert used == 3 and [float(c[0]) for c in chunks] == [2.0] and float(state[0]) == 2.0
    assert cache.longest_resumable(keys, is_resumable=lambda n: n != 1) == (0, [], None)
    assert len(cache) == 3 and cache.num_checkpoints == 2


def test_a_checkpoint_evicted_while_its_chunks_stay_is_no_hit_and_the_reverse():
    keys = [b"k0", b"k1"]
    cache = _cache_with(keys, [keys[1]], capacity=2 * 16 + 8)  # two chunks and one checkpoint fill it
    assert cache.longest_resumable(keys)[0] == 2
    cache.insert(b"other", torch.zeros(2))  # the least recently used goes: chunk k1 (a lookup touches tails first)
    assert keys[1] not in cache and cache.num_checkpoints == 1
    assert cache.longest_resumable(keys) == (0, [], None)  # the state at k1 is held, the KV before it is not
    cache = _cache_with(keys, [keys[1]], capacity=2 * 16 + 8)
    assert len(cache.longest_prefix(keys)) == 2  # an attention lookup touches the chunks only
    cache.insert(b"other", torch.zeros(2))  # so the checkpoint is the oldest entry
    assert cache.num_checkpoints == 0 and keys[0] in cache and keys[1] in cache
    assert cache.longest_resumable(keys) == (0, [], None)


def test_checkpoints_are_never_announced_as_kv_blocks():
    class Listener:
        def __init__(self):
            self.announced, self.gone = [], []

        def stored(self, keys, ids, is_held):
            self.announced.extend(keys)

        def removed(self, key):
            self.gone.append(key)

    cache = LocalPrefixCache(2 * 16)
    cache.listener = listener = Listener()
    cache.insert_prompt([b"a", b"b"], lambda i: torch.zeros(4))  # b inserted first, a last
    cache.insert_checkpoint(b"a", torch.zeros(4))  # room for it: b goes (announced)
    cache.insert(b"c", torch.zeros(4))  # a goes (announced)
    cache.insert(b"d", torch.zeros(4))  # the checkpoint goes: not announced
    assert listener.announced == [b"a", b"b"] and listener.gone == [b"b", b"a"]
    assert cache.num_checkpoints == 0 and len(cache) == 2
