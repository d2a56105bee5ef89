"""Decoding: greedy, seeded sampling, top-p/top-k/min-p, logit_bias, penalties, stop tokens, max_tokens, logprobs,
limits."""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, SamplingParams
from kvshare.engine.sampler import TokenCounts, make_generator, process_logits, sample


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
    seen = {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), make_generator(s)).token_id for s in range(200)}
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
    assert sample(logits, SamplingParams(temperature=1e-9), make_generator(0)).token_id == 1  # greedy, no overflow
    # top_p rounds to 0 in float32: keep the best
    assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-50), make_generator(0)).token_id == 1
    assert sample(logits, SamplingParams(temperature=0.7, top_p=1e-6), make_generator(1)).token_id == 1


# -- the parameters vLLM and OpenAI add -------------------------------------------


def _drawn(logits, params, num_seeds=300):
    return {sample(logits, params, make_generator(s)).token_id for s in range(num_seeds)}


def test_top_k_keeps_the_k_most_likely_tokens():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert _drawn(logits, SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert _drawn(logits, SamplingParams(temperature=1.0)) == {0, 1, 2, 3}  # the control
    assert _drawn(logits, SamplingParams(temperature=1.0, top_k=1)) == {0}


def test_min_p_drops_tokens_less_likely_than_min_p_times_the_best():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert _drawn(logits, SamplingParams(temperature=1.0, min_p=0.5)) == {0, 1}  # 0.3 >= 0.25 > 0.15
    assert _drawn(logits, SamplingParams(temperature=1.0, min_p=1.0)) == {0}


def test_logit_bias_adds_to_the_logits_and_forces_or_bans():
    logits = torch.tensor([2.0, 1.0, 0.0])
    assert process_logits(logits, SamplingParams(logit_bias=((2, 5.0), (0, -1.5))), None).tolist() == [0.5, 1.0, 5.0]
    assert sample(logits, SamplingParams(logit_bias=((2, 100.0),)), make_generator(0)).token_id == 2
    assert _drawn(logits, SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0)))) == {2}
    assert logits.tolist() == [2.0, 1.0, 0.0]  # the model's row is not changed


def test_penalties_follow_vllm_and_openai_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    counts = TokenCounts(4, torch.tensor([0, 1]))  # the prompt holds tokens 0 and 1
    counts.add(2), counts.add(2), counts.add(3)  # generated so far: 2 twice, 3 once
    # repetition (vLLM): every token of the prompt or the output, logit / p when positive, * p otherwise
    assert process_logits(logits, SamplingParams(repetition_penalty=2.0), counts).tolist() == [1.0, -2.0, 0.25, 1.5]
    # frequency and presence (OpenAI): generated tokens only, per occurrence and once
    assert process_logits(logits, SamplingParams(frequency_penalty=0.5), counts).tolist() == [2.0, -1.0, -0.5, 2.5]
    assert process_logits(logits, SamplingParams(presence_penalty=0.5), counts).tolist() == [2.0, -1.0, 0.0, 2.5]
    assert process_logits(logits, SamplingParams(presence_penalty=-1.0), counts).tolist() == [2.0, -1.0, 1.5, 4.0]
    with pytest.raises(ValueError, match="TokenCounts"):
        process_logits(logits, SamplingParams(presence_penalty=0.5), None)


def test_logprobs_are_the_models_before_bias_and_penalties():
    logits = torch.tensor([2.0, 1.0, 0.0])
    plain = sample(logits, SamplingParams(logprobs=3), make_generator(0))
    biased = sample(logits, SamplingParams(logprobs=3, logit_bias=((2, 100.0),)), make_generator(0))
    assert biased.token_id == 2 and biased.top_logprobs == plain.top_logprobs  # as vLLM's default raw_logprobs
    assert biased.logprob == pytest.approx(plain.top_logprobs[2])


def test_top_k_and_min_p_at_their_limits_are_greedy(engine):
    greedy, _ = _ids(engine, max_tokens=12, ignore_eos=True)
    assert _ids(engine, max_tokens=12, temperature=1.0, top_k=1, seed=5, ignore_eos=True)[0] == greedy
    assert _ids(engine, max_tokens=12, temperature=1.0, min_p=1.0, seed=5, ignore_eos=True)[0] == greedy
    assert _ids(engine, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)[0] != greedy  # the control


def test_logit_bias_forces_a_token_in_the_engine(engine):
    forced, _ = _ids(engine, max_tokens=6, ignore_eos=True, logit_bias=((65, 100.0),))
    assert forced == [65] * 6
    greedy, _ = _ids(engine, max_tokens=6, ignore_eos=True)
    banned, _ = _ids(engine, max_tokens=6, ignore_eos=True, logit_bias=((greedy[0], -100.0),))
    assert banned[0] != greedy[0]


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}]
)
def test_penalties_turn_greedy_away_from_tokens_already_seen(engine, penalty):
    prompt = engine.tokenizer.encode("The sampling test prompt")
    greedy, _ = _ids(engine, max_tokens=60, ignore_eos=True)
    assert len(set(greedy)) < len(greedy)  # greedy repeats itself: something to penalise
    penalised, _ = _ids(engine, max_tokens=60, ignore_eos=True, **penalty)
    assert penalised != greedy
    step = next(i for i, (a, b) in enumerate(zip(greedy, penalised)) if a != b)
    # a penalty only lowers the logits of tokens seen before: greedy leaves a token it had already produced
    # (or, for repetition_penalty, one of the prompt's)
    seen = set(greedy[:step]) | (set(prompt) if "repetition_penalty" in penalty else set())
    assert greedy[step] in seen


def test_extreme_penalties_still_sample():
    logits = torch.tensor([30.0, 20.0, -5.0, 1.0])
    counts = TokenCounts(4, torch.tensor([0, 1]))
    tiny = SamplingParams(temperature=1e-4, repetition_penalty=1e-38)  # 30 / 1e-38 is inf in float32
    assert process_logits(logits, tiny, counts)[0] == float("inf")
    assert sample(logits, tiny, make_generator(0), counts).token_id in (0, 1)  # no NaN probabilities
    assert sample(
        logits, SamplingParams(temperature=2.0, repetition_penalty=1e30), make_generator(0), counts
    ).token_id in (0, 1, 2, 3)


@pytest.mark.parametrize(
    "bad",
    [
        {"top_k": -1},
        {"min_p": 1.5},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0.0},
        {"logit_bias": ((1, 101.0),)},
        {"temperature": float("nan")},
    ],
)
def test_sampling_params_refuse_out_of_range_values(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def _greedy_on_cpu_row(logits: torch.Tensor, num_logprobs):
    """The general path's greedy step on a CPU row: what the device path must give."""
    from kvshare.engine.sampler import _with_logprobs

    raw = logits.detach().float().cpu()
    return _with_logprobs(raw, int(torch.argmax(raw)), num_logprobs)


@pytest.mark.parametrize("num_logprobs", [None, 0, 1, 5, 20])
def test_greedy_where_the_logits_are_equals_the_cpu_path(num_logprobs):
    from kvshare.engine.sampler import _greedy_where_logits_are

    rows = [torch.randn(1000, generator=torch.Generator().manual_seed(s)) * 4 for s in range(5)]
    tied = torch.zeros(1000)
    tied[[7, 3, 900]] = 2.0  # ties: the first maximal id wins on either path
    banned = rows[0].clone()
    banned[:500] = -float("inf")
    for row in rows + [tied, banned, rows[1].to(torch.bfloat16)]:
        got = _greedy_where_logits_are(row, num_logprobs)
        assert got == _greedy_on_cpu_row(row, num_logprobs)
        assert got == sample(row, SamplingParams(logprobs=num_logprobs), make_generator(0))  # sample() takes it
    assert _greedy_where_logits_are(tied, None).token_id == 3


def test_greedy_with_a_bias_or_penalties_takes_the_general_path():
    logits = torch.tensor([3.0, 2.0, 1.0])
    biased = sample(logits, SamplingParams(logit_bias=((2, 5.0),), logprobs=1), make_generator(0))
    assert biased.token_id == 2 and biased.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[2]))
    counts = TokenCounts(3, torch.tensor([0]))
    penalised = sample(logits, SamplingParams(repetition_penalty=2.0), make_generator(0), counts)
    assert penalised.token_id == 1  # 3.0 / 2 < 2.0
