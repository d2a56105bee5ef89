"""An OpenAI request as the engine takes it (``Prepared``), checked against the model and this replica first.

``api_types.validate`` has checked what the request says on its own (ranges, options); what needs the model
or the replica's limits is checked here, before the engine sees the request, and refused with vLLM's message
where vLLM has one::

    prompt ids        one int64 array, each id in [0, vocab_size)
    max_tokens        fits the model's context (--max-model-len) and this replica's limits
    sampling          the engine's SamplingParams (kvshare.engine.sampler), token ids in the vocabulary

The sampling parameters keep vLLM's semantics; the mapping of each field::

    temperature < 1e-5        greedy (vLLM's _SAMPLING_EPS: logits / t would overflow)
    top_p                     at least 1e-6 (float32 rounds smaller values to 0, which would cut every token)
    top_k None, 0 or -1       off
    logit_bias {"id": bias}   (id, bias) pairs; ids must lie in the vocabulary
    stop_token_ids            end the request with finish_reason "stop" (the token's text is not returned)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvshare.serve.api_types import ApiError, ChatRequest, CompletionRequest

MIN_TOP_P = 1e-6


@dataclass
class Prepared:
    """A validated request as the engine takes it (``params``: SamplingParams, ``options``: RequestOptions)."""

    prompt_ids: Any  # list[int], or the int64 array a token-id completion was read into
    params: Any
    options: Any
    stops: list[str]
    include_usage: bool
    prompt_array: Any = None  # the same ids as one int64 numpy array, what the engine takes (None: build it)
    is_usage_continuous: bool = False  # stream_options.continuous_usage_stats (with include_usage): usage per chunk


def checked_prompt_ids(prompt_ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """The prompt's token ids as one int64 array, each in [0, vocab_size); an empty prompt or an id outside is a 400."""
    if len(prompt_ids) == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt_ids, np.ndarray):  # token ids read by decode_completion
        ids = prompt_ids
    else:
        try:  # one array, checked at once: a 32k-token list's min() and max() alone cost ~1 ms of TTFT
            ids = np.fromiter(prompt_ids, dtype=np.int64, count=len(prompt_ids))
        except OverflowError:
            ids = None
    if ids is None or not 0 <= ids.min() <= ids.max() < vocab_size:
        raise ApiError(400, f"token ids must lie in [0, {vocab_size})", param="prompt")
    return ids


def checked_max_tokens(
    requested: tuple[str, int | None],
    num_prompt: int,
    what: str,
    default: int,
    *,
    context: int,
    max_prompt_tokens: int | None,
    max_tokens_limit: int | None,
) -> int:
    """The request's output bound (``requested``: the field it was given in and its value; ``default`` when
    none, cut to the room left), checked against the model's context (--max-model-len, vLLM's message) and
    this replica's limits (--max-tokens-limit: none by default, as vLLM has none); ``what`` names the prompt's
    field ("prompt" or "messages") in the messages, and the errors name the field the request used."""
    if num_prompt >= context:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens. However, your prompt "
            f"contains {num_prompt} input tokens, which leaves no room for an output token. "
            f"Please reduce the length of the {what}.",
            param=what,
            code="context_length_exceeded",
        )
    if max_prompt_tokens and num_prompt > max_prompt_tokens:
        raise ApiError(
            400,
            f"the prompt has {num_prompt} tokens; this replica takes at most {max_prompt_tokens} (--max-prompt-tokens)",
            param=what,
            code="context_length_exceeded",
        )
    room = context - num_prompt
    field, value = requested
    if value is None:
        return min(default, room, max_tokens_limit or room)
    if value < 1:  # vLLM's message
        raise ApiError(400, f"{field} must be at least 1, got {value}.", param=field)
    if value > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{num_prompt + value} tokens ({num_prompt} in the {what}, {value} in the "
            f"completion). Please reduce the length of the {what} or completion.",
            param=field,
            code="context_length_exceeded",
        )
    if max_tokens_limit is not None and value > max_tokens_limit:
        raise ApiError(
            400, f"{field} may be at most {max_tokens_limit} on this replica (--max-tokens-limit)", param=field
        )
    return value


def sampling_params(
    req: CompletionRequest | ChatRequest, max_tokens: int, logprobs: int | None, vocab_size: int
) -> Any:
    """The engine's SamplingParams for a validated request; ApiError(400) for token ids outside the vocabulary."""
    from kvshare.engine.sampler import GREEDY_BELOW, SamplingParams  # torch: imported where used

    logit_bias = tuple((int(key), float(bias)) for key, bias in (req.logit_bias or {}).items())
    _check_token_ids([i for i, _ in logit_bias], vocab_size, "logit_bias")
    stop_token_ids = tuple(req.stop_token_ids or ())
    _check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    # found by fuzzing: a temperature of 1e-82 overflowed the scaled logits to inf, and sampling failed with a 500
    temperature = 0.0 if req.temperature < GREEDY_BELOW else req.temperature
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
        raise ApiError(400, f"{param} names token id {bad[0]}, outside the vocabulary [0, {vocab_size})", param=param)
