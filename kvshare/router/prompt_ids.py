"""pool_aware's token ids of a request's prompt: what a replica will compute, as far as placing it needs them.

A text prompt (a chat rendered by the model's template) must be encoded to be hashed into chunks, and every
request waits for its placement. A chat's next turn repeats all but its end, and the tokenizer cuts texts into
pieces cached by content (kvshare.engine.token_cache), so the ids of its leading pieces are known at once; they
are an exact prefix of the whole text's ids (pieces end at safe points). Text that no earlier prompt of this
router held reached no replica or pool through it (only through another router, or as a replica's own answer,
a few tokens at a tail's head), so where only a short tail is new the request is placed on the known prefix and
sent while the tail is encoded off the loop; the sent memory takes the prompt's whole chain once it is in
(kvshare.router.pool_aware)::

    text:   |<- known pieces (ids looked up) ->|<- new tail: encoded after the request is sent ->|
    placed: [ chunk 0 ][ chunk 1 ] ... [ k-1 ]  + the tail's tokens, estimated from the known chars/token

A prompt whose first piece is new, or whose new tail exceeds ``DEFER_MAX_CHARS`` (a conversation this router
did not place, a router started afresh), is encoded whole before it is placed: its held prefix may lie there.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, replace

log = logging.getLogger("kvshare.router.pool_aware")
# The placer tokenizes every text prompt before its request can be sent. A chat's next turn repeats all but its
# end, so every text is cut into pieces of about this many characters and only pieces no earlier prompt held are
# encoded (kvshare.engine.token_cache); a replica's defaults (one plain encode below 16 KiB, 8 KiB pieces above)
# re-encode all of a prompt under 16 KiB, up to 8 KiB of a longer one. What every placement pays on the loop is
# the look-up; 2 CPU cores, the presets' BPE, 2026-12-06 (benchmarks/router_latency_cpu.py pieces): later turns of
# 6-10k tokens encode in 2.8 ms with 8 KiB pieces, 1.8 with 2 KiB or 1 KiB; a held 128k-token text is looked up
# in 0.5, 1.0 and 2.6 ms.
PLACER_PIECE_CHARS = 2048
# a longer new tail is encoded before placing: it may hold chunks another router's conversation left in the pool
# (at most this much of a prompt is left out of its held prefix: ~1.4k tokens of the presets' BPE)
DEFER_MAX_CHARS = 8192


@dataclass(frozen=True)
class PromptText:
    """A request's prompt as the text its ids come from (a chat rendered by the template): ``encoded`` gives them."""

    text: str


@dataclass(frozen=True)
class KnownPrefix:
    """A text prompt whose new tail is still being encoded: the ids of its leading pieces (an exact prefix of its
    ids), its whole length estimated, and the future of its whole ids (an int64 array, resolved on the loop)."""

    ids: object  # int64 array
    num_tokens: int  # len(ids) + the tail's tokens at the known pieces' tokens per character
    whole: asyncio.Future


def placer_tokenizer(model: str):
    """The tokenizer of the replicas' ``model`` (a directory or a preset), cutting every text into pieces of
    PLACER_PIECE_CHARS; loaded without the model's weights (no torch: kvshare.engine.tokenizer_loader)."""
    from kvshare.engine.token_cache import TokenCacheConfig
    from kvshare.engine.tokenizer_loader import load_tokenizer

    return load_tokenizer(model, TokenCacheConfig(piece_chars=PLACER_PIECE_CHARS, min_chars=0))


def prompt_of(tokenizer, prompt, messages):
    """The token ids a replica would compute for the request (a list), a text (a chat rendered) as a PromptText
    where the tokenizer looks pieces up; None where this router cannot tell."""
    try:
        encode_array = getattr(tokenizer, "encode_array", None)
        text = PromptText if hasattr(tokenizer, "look_up") else encode_array
        if messages is not None:
            if encode_array is not None:
                return text(tokenizer.chat_text(messages))
            return list(tokenizer.apply_chat_template(messages))
        if isinstance(prompt, str):
            return tokenizer.encode(prompt) if encode_array is None else text(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            # ids beyond 4 bytes hash to nothing the pool holds: the replica refuses them; place without a prefix
            return prompt if not prompt or (min(prompt) >= 0 and max(prompt) < 1 << 32) else None
    except Exception as exc:  # a malformed request: the replica answers it; place it without a prefix
        log.debug("pool_aware: no token ids for a request (%s)", exc)
    return None


def prompt_ids(tokenizer, prompt, messages):
    """``prompt_of`` with a text's ids (an int64 array, without a list between); None where they cannot be had."""
    found = prompt_of(tokenizer, prompt, messages)
    try:
        return tokenizer.encode_array(found.text) if isinstance(found, PromptText) else found
    except Exception as exc:
        log.debug("pool_aware: no token ids for a request (%s)", exc)
    return None


async def encoded(tokenizer, facts):
    """``facts`` (policy.RouteFacts) with a PromptText's ids: a KnownPrefix where only a short tail is new (module
    docstring), else the whole ids (what no cache holds encoded off the loop where long, as
    kvshare.serve.tokenize.prompt_array does); None where they cannot be had."""
    from kvshare.serve.off_loop import off_loop

    try:
        if not isinstance(facts.prompt_ids, PromptText):
            return facts
        text = facts.prompt_ids.text
        lookup = tokenizer.look_up(text)
        ids = _known_prefix(tokenizer, text, lookup)
        if ids is None:
            ids = await off_loop(tokenizer.encode_missing, lookup, num_chars=lookup.num_missing_chars)
        return replace(facts, prompt_ids=ids)
    except Exception as exc:
        log.debug("pool_aware: no token ids for a request (%s)", exc)
    return replace(facts, prompt_ids=None)


def _known_prefix(tokenizer, text: str, lookup) -> KnownPrefix | None:
    """The text's KnownPrefix, its tail's encode started on the loop's executor; None where the text is to be
    encoded first (whole, not cut into pieces; its first piece new or its new tail long; or nothing new)."""
    import numpy as np

    found = lookup.found
    num_known = next((k for k, ids in enumerate(found) if ids is None), len(found))
    if lookup.keys is None or num_known in (0, len(found)):
        return None
    known_chars = sum(len(p) for p in lookup.pieces[:num_known])
    if len(text) - known_chars > DEFER_MAX_CHARS:
        return None
    ids = np.concatenate(found[:num_known], dtype=np.int64)
    num_tokens = len(ids) + math.ceil((len(text) - known_chars) * len(ids) / known_chars)
    whole = asyncio.get_running_loop().run_in_executor(None, tokenizer.encode_missing, lookup)
    return KnownPrefix(ids, num_tokens, whole)
