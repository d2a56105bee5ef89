"""A request's limits, checked before the engine sees it (pure): its token ids lie in the vocabulary, and its
max_tokens fits the model's context and this replica's limits, refused with vLLM's message where vLLM has one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvshare.serve.api_types import ApiError


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
