"""Decoding: greedy, seeded sampling, top-p, stop tokens, max_tokens, logprobs, limits."""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, SamplingParams
from kvshare.engine.sampler import make_generator, sample


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", chunk_tokens=16, max_model_len=128))


def _ids(engine, prompt="The sampling test prompt", **params):
    events = list(engine.generate(engine.tokenizer.encode(prompt), SamplingParams(**params)))
    return [e.token_id for e in events], events


def test_seeded_sampling_is_reproducible(engine):
    a, _ = _ids(engine, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    b, _ = _ids(engine, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    c, _ = _ids(engine, max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
    greedy, _ = _ids(engine, max_tokens=16, ignore_eos=True)
    assert a == b
    assert a != c and a != greedy


def test_tiny_top_p_is_greedy(engine):
    greedy, _ = _ids(engine, max_tokens=12, ignore_eos=True)
    nucleus, _ = _ids(engine, max_tokens=12, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)
    assert nucleus == greedy


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen = {sample(logits, 1.0, 0.7, make_generator(s)).token_id for s in range(200)}
    assert seen == {0, 1}


def test_stop_tokens_and_length(engine):
    greedy, events = _ids(engine, max_tokens=10, ignore_eos=True)
    assert [e.finish_reason for e in events] == [None] * 9 + ["length"]
    assert len({id(e.provenance) for e in events}) == 1  # one provenance object per request
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    stopped, events = _ids(engine, max_tokens=10, ignore_eos=True, stop_token_ids=(stop_at,))
    assert stopped == greedy[: first + 1] and events[-1].finish_reason == "stop"


def test_eos_stops_unless_ignored(engine):
    eos = engine.tokenizer.eos_token_id
    greedy, _ = _ids(engine, max_tokens=6, ignore_eos=True)
    engine.tokenizer.eos_token_ids = (eos, greedy[2])  # pretend the third token is an end-of-sequence id
    try:
        stopped, events = _ids(engine, max_tokens=6)
    finally:
        engine.tokenizer.eos_token_ids = (eos, 259)
    assert stopped == greedy[:3] and events[-1].finish_reason == "stop"


def test_logprobs(engine):
    _, events = _ids(engine, max_tokens=5, logprobs=3, ignore_eos=True)
    for e in events:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0.0
        assert max(e.top_logprobs.values()) == pytest.approx(e.logprob)  # greedy picks the most likely
        assert e.top_logprobs[e.token_id] == pytest.approx(e.logprob)
    _, events = _ids(engine, max_tokens=2)
    assert events[0].logprob is None and events[0].top_logprobs is None


def test_max_model_len(engine):
    prompt = [65] * 120
    events = list(engine.generate(prompt, SamplingParams(max_tokens=50, ignore_eos=True)))
    assert len(events) == 8 and events[-1].finish_reason == "length"  # 120 + 8 = max_model_len 128
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([65] * 128, SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([65, 999], SamplingParams())
    with pytest.raises(ValueError, match="no tokens"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(EngineConfig(model="tiny", max_model_len=10**6))


def test_tiny_temperature_and_top_p_do_not_break_sampling():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert sample(logits, 1e-9, 1.0, make_generator(0)).token_id == 1  # greedy, not an overflow
    assert sample(logits, 1.0, 1e-50, make_generator(0)).token_id == 1  # top_p rounds to 0: keep the best
    assert sample(logits, 0.7, 1e-6, make_generator(1)).token_id == 1
