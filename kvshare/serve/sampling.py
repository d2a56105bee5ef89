"""An OpenAI request's sampling parameters as the engine takes them (kvshare.engine.sampler.SamplingParams).

``api_types.validate`` has checked the ranges; what needs the model (token ids against its
vocabulary) is checked here. The semantics are vLLM's; the mapping of each field::

    temperature < 1e-5        greedy (vLLM's _SAMPLING_EPS: logits / t would overflow)
    top_p                     at least 1e-6 (float32 rounds smaller values to 0, which would cut every token)
    top_k None, 0 or -1       off
    logit_bias {"id": bias}   (id, bias) pairs; ids must lie in the vocabulary
    stop_token_ids            end the request with finish_reason "stop" (the token's text is not returned)
"""

from __future__ import annotations

from typing import Any

from kvshare.serve import api_types as A

GREEDY_BELOW_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6


def sampling_params(
    req: A.CompletionRequest | A.ChatRequest, max_tokens: int, logprobs: int | None, vocab_size: int
) -> Any:
    """The engine's SamplingParams for a validated request; ApiError(400) for token ids outside the vocabulary."""
    from kvshare.engine.sampler import SamplingParams  # torch: imported where used

    logit_bias = tuple((int(key), float(bias)) for key, bias in (req.logit_bias or {}).items())
    _check_token_ids([i for i, _ in logit_bias], vocab_size, "logit_bias")
    stop_token_ids = tuple(req.stop_token_ids or ())
    _check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    # found by fuzzing: a temperature of 1e-82 overflowed the scaled logits to inf, and sampling failed with a 500
    temperature = 0.0 if req.temperature < GREEDY_BELOW_TEMPERATURE else req.temperature
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=max(req.top_p, MIN_TOP_P),
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=logit_bias,
        seed=req.seed,
        stop_token_ids=stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )


def _check_token_ids(ids, vocab_size: int, param: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise A.ApiError(400, f"{param} names token id {bad[0]}, outside the vocabulary [0, {vocab_size})", param=param)
