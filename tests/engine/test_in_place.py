"""The last request's tokens still in the sequence KV are reused in place (kvshare.engine.kv_cache.HeldSequence).

The same prompt again computes its last token alone, a chat's next turn its new turn alone, with the cold
run's tokens (greedy, float32). Nothing is reused in place across tenants, after a request that failed or was
cancelled, after a cold request, after chunks were dropped, after the KV grew, or in the deterministic mode."""

from __future__ import annotations

import pytest

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.errors import RequestCancelled
from tests.engine.conftest import ascii_prompt

CHUNK = 16
COLD = RequestOptions(use_pool=False, use_local_cache=False)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def run(engine: Engine, ids: list[int], options: RequestOptions = RequestOptions()):
    events = list(engine.generate(ids, PARAMS, options))
    p = events[0].provenance
    return [e.token_id for e in events], (p.local_tokens, p.pool_tokens, p.computed_tokens)


@pytest.fixture
def engine(tiny_dir):
    return Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, preallocate_kv=True, max_model_len=512))


def test_the_same_prompt_again_computes_its_last_token_alone(engine):
    ids = engine.tokenizer.encode(ascii_prompt(64, seed=1))
    cold, _ = run(engine, ids, COLD)
    assert run(engine, ids) == (cold, (0, 0, 64))
    hits = engine.stats().local_hit_chunks
    assert run(engine, ids) == (cold, (63, 0, 1))  # a whole chunk (16 tokens) without it
    assert engine.stats().local_hit_chunks == hits  # nothing copied from the local cache


def test_a_chats_next_turn_computes_its_new_turn_alone(engine):
    ids = engine.tokenizer.encode(ascii_prompt(50, seed=2))
    answer, _ = run(engine, ids)
    turn = engine.tokenizer.encode(ascii_prompt(20, seed=3))
    follow = ids + answer + turn
    cold, _ = run_cold_elsewhere(engine, follow)
    fed = len(ids) + len(answer) - 1  # the last answer token was sampled, never fed back
    assert run(engine, follow) == (cold, (fed, 0, len(follow) - fed))


def run_cold_elsewhere(engine: Engine, ids: list[int]):
    """A cold run on another engine of the same model: this one's held tokens stay as they are."""
    other = Engine(EngineConfig(model=engine.config.model, chunk_tokens=CHUNK))
    try:
        return run(other, ids, COLD)
    finally:
        other.close()


def test_nothing_is_reused_in_place_across_tenants(engine):
    ids = engine.tokenizer.encode(ascii_prompt(40, seed=4))
    cold, _ = run(engine, ids)
    assert run(engine, ids, RequestOptions(tenant="someone else")) == (cold, (0, 0, 40))
    assert run(engine, ids, RequestOptions(tenant="someone else")) == (cold, (39, 0, 1))  # its own, next time


def test_a_cold_request_leaves_nothing_in_place_and_ends_what_was(engine):
    ids = engine.tokenizer.encode(ascii_prompt(40, seed=5))
    cold, _ = run(engine, ids)
    run(engine, ids, COLD)
    assert run(engine, ids) == (cold, (32, 0, 8))  # the local cache's two chunks, not the cold run's tokens


def test_a_cancelled_prefill_leaves_nothing_in_place(engine):
    ids = engine.tokenizer.encode(ascii_prompt(40, seed=6))
    cold, _ = run(engine, ids)
    other = engine.tokenizer.encode(ascii_prompt(45, seed=7))
    with pytest.raises(RequestCancelled):
        list(engine.generate(ids[:20] + other, PARAMS, RequestOptions(is_cancelled=lambda: True)))
    assert run(engine, ids) == (cold, (32, 0, 8))


def test_dropped_chunks_end_what_was_in_place(engine):
    ids = engine.tokenizer.encode(ascii_prompt(40, seed=8))
    cold, _ = run(engine, ids)
    assert engine.drop_chunks(engine.prompt_chunk_keys(ids)) == (2, 0)
    assert run(engine, ids) == (cold, (0, 0, 40))


def test_a_grown_kv_holds_nothing(tiny_dir):
    engine = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, preallocate_kv=False, reuse_in_place=True))
    short = engine.tokenizer.encode(ascii_prompt(20, seed=9))
    run(engine, short)
    longer = short + engine.tokenizer.encode(ascii_prompt(300, seed=10))
    cold, _ = run_cold_elsewhere(engine, longer)
    assert run(engine, longer) == (cold, (16, 0, len(longer) - 16))  # a new buffer: the local cache's chunk


def test_the_deterministic_mode_reuses_on_its_grid_only(tiny_dir):
    engine = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, deterministic=True))
    ids = engine.tokenizer.encode(ascii_prompt(40, seed=11))
    cold, _ = run(engine, ids)
    assert run(engine, ids) == (cold, (32, 0, 8))


def test_off_it_reuses_whole_chunks(tiny_dir):
    engine = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, reuse_in_place=False))
    ids = engine.tokenizer.encode(ascii_prompt(40, seed=12))
    cold, _ = run(engine, ids)
    assert run(engine, ids) == (cold, (32, 0, 8))


def test_the_pools_chunks_go_on_from_the_chunk_the_tokens_in_place_end_in(tiny_dir, pool_socket):
    a, b = (Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket)) for _ in range(2))
    ids = a.tokenizer.encode(ascii_prompt(80, seed=13))
    cold, _ = run(b, ids, COLD)
    run(a, ids[:40])  # in place: its 40 tokens (and the answer's, which part from ids)
    run(b, ids)  # the pool: every full chunk of ids
    # in place up to 40; the pool's chunks 2 and 3 from token 32 (32..40 overwritten by the same tokens' KV)
    assert run(a, ids) == (cold, (32, 32, 16))


def test_whatever_else_takes_the_kv_ends_what_was_in_place(engine):
    """The suffix kernels' warm-up writes the sequence KV outside any request: what it held is gone (fails
    when only requests forget it: the next request reuses the warm-up's KV as the last prompt's)."""
    from kvshare.engine.warmup import warm_suffix_kernels

    ids = engine.tokenizer.encode(ascii_prompt(120, seed=14))
    cold, _ = run(engine, ids)
    assert warm_suffix_kernels(engine, prefixes=(64,), lengths=(1, 3)) == 2
    assert run(engine, ids) == (cold, (112, 0, 8))  # the local cache's seven chunks


def test_an_overlap_shorter_than_a_chunk_and_half_the_prompt_is_computed_again(engine):
    """A shared template's first tokens under a longer prompt: reused, the suffix's attention would cost more than
    the tokens it saves where it takes a mask (kvshare.engine.kv_cache.HeldSequence)."""
    ids = engine.tokenizer.encode(ascii_prompt(40, seed=15))
    run(engine, ids)
    other = ids[:10] + engine.tokenizer.encode(ascii_prompt(30, seed=16))
    cold, _ = run_cold_elsewhere(engine, other)
    assert run(engine, other) == (cold, (0, 0, 40))  # 10 tokens in common: below the chunk of 16 and 40 / 2


def test_a_prompt_shorter_than_a_chunk_again_computes_its_last_token_alone(engine):
    """Fails when in-place reuse starts at a whole chunk: a prompt shorter than one is then never reused."""
    ids = engine.tokenizer.encode(ascii_prompt(12, seed=17))  # below the chunk of 16: nothing for the caches
    cold, _ = run(engine, ids, COLD)
    assert run(engine, ids) == (cold, (0, 0, 12))
    assert run(engine, ids) == (cold, (11, 0, 1))


def test_a_short_chats_next_turn_computes_its_new_turn_alone(engine):
    """Fails when in-place reuse starts at a whole chunk: a chat shorter than one computes every turn whole."""
    ids = engine.tokenizer.encode(ascii_prompt(6, seed=18))
    answer, _ = run(engine, ids)
    follow = ids + answer + engine.tokenizer.encode(ascii_prompt(5, seed=19))  # 19 tokens: one chunk and 3
    cold, _ = run_cold_elsewhere(engine, follow)
    fed = len(ids) + len(answer) - 1  # 13: the last answer token was sampled, never fed back
    assert run(engine, follow) == (cold, (fed, 0, len(follow) - fed))


def test_an_overlap_of_half_the_prompt_is_reused_in_place(engine):
    ids = engine.tokenizer.encode(ascii_prompt(12, seed=20))
    run(engine, ids)
    other = ids[:10] + engine.tokenizer.encode(ascii_prompt(10, seed=21))
    cold, _ = run_cold_elsewhere(engine, other)
    assert run(engine, other) == (cold, (10, 0, 10))  # 10 tokens in common: half of 20


def test_a_callers_array_changed_after_its_request_is_not_what_is_held(engine):
    """The engine keeps its own copy of the tokens it holds (fails when it keeps the caller's int64 array: the
    changed array then matches itself, and its first 47 tokens are "reused" with the old tokens' KV)."""
    import numpy as np

    ids = np.asarray(engine.tokenizer.encode(ascii_prompt(48, seed=17)), dtype=np.int64)
    list(engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True)))  # one token: nothing fed back
    ids[:] = engine.tokenizer.encode(ascii_prompt(48, seed=18))
    cold, _ = run_cold_elsewhere(engine, ids.tolist())
    assert run(engine, ids) == (cold, (0, 0, 48))


def test_any_overlap_of_a_prompt_within_a_chunk_is_reused_in_place(engine):
    """Fails when a chat's next turn shorter than a chunk is computed whole because its new part is longer than
    what came before (the tiny model's answers re-encode to other tokens, so often only the prompt is in place)."""
    ids = engine.tokenizer.encode(ascii_prompt(12, seed=22))
    run(engine, ids)
    other = ids[:4] + engine.tokenizer.encode(ascii_prompt(10, seed=23))  # 14 tokens, 4 in common: under 14 / 2
    cold, _ = run_cold_elsewhere(engine, other)
    assert run(engine, other) == (cold, (4, 0, 10))
