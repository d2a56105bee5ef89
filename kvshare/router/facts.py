"""What the router reads of a request's body to place it (pure): the session, the chat turn and, for the
policies that look at the prompt itself (cache_aware, pool_aware), the prompt's prefix blocks or token ids under
the salt the replica's keys will carry. A body that does not decode is placed as one that says nothing; the
replica answers it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from kvshare.router.policy import RouteFacts, prefix_blocks

_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


class _Facts(msgspec.Struct):
    user: str | None = None
    messages: list[dict] | None = None
    prompt: object = None
    cache_salt: object = None  # a string when valid; the replica refuses anything else


class _PoolFacts(msgspec.Struct):
    """What pool_aware reads: the prompt kept as its JSON bytes until its form is known (``_token_ids``)."""

    user: str | None = None
    messages: list[dict] | None = None
    prompt: msgspec.Raw = msgspec.Raw(b"null")
    cache_salt: object = None
    stream: object = None  # only true streams: a response that is not one shows nothing before its end


# a token id the pool can hash (4 unsigned bytes); JSON's true/false are not ints here
_TokenIds = list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]]


def token_ids(raw: msgspec.Raw) -> list[int] | None:
    """A prompt of token ids, checked in msgspec's C decoder (a 128k-token prompt checked id by id in Python
    took ~40 ms of the router's loop on 2 cores); None for any other form."""
    if memoryview(raw)[:1].tobytes() != b"[":
        return None
    try:
        return msgspec.json.decode(raw, type=_TokenIds)
    except _DECODE_ERRORS:
        return None


class _PlacementFacts(msgspec.Struct):
    """What alternate and sticky read: the prompt is skipped, never built as Python objects (a 128k-token
    prompt: ~15 ms of the router's time to first byte when it was)."""

    user: str | None = None
    messages: list[dict] | None = None


def route_facts(
    policy: str, body: bytes, session: str | None, salt_of: Callable[[str | None], str], pool_aware: Any = None
) -> RouteFacts:
    """The facts ``policy`` places a request by. ``session``: the session header's value (else the body's user);
    ``salt_of(cache_salt)``: the salt of the replica's keys given the body's cache_salt; ``pool_aware``: the KV
    events' index (kvshare.router.pool_aware), whose token ids replace the prefix blocks (a text's still to encode:
    a PromptText)."""
    if policy == "round_robin":
        return RouteFacts()  # it reads nothing of the request: the body goes on unread (~2-3 ms at 128k)
    hashes = policy in ("cache_aware", "pool_aware")  # the policies that read the prompt itself
    kind = _PlacementFacts if not hashes else _PoolFacts if pool_aware is not None else _Facts
    try:
        parsed = msgspec.json.decode(body, type=kind) if body else kind()
    except _DECODE_ERRORS:
        parsed = kind()  # the replica will answer the bad request; just place it
    session = session or parsed.user
    turn, text = None, ""
    if parsed.messages is not None:
        turn = sum(1 for m in parsed.messages if isinstance(m, dict) and m.get("role") == "assistant")
        if hashes:
            text = "".join(f"{m.get('role')}:{m.get('content')}\n" for m in parsed.messages if isinstance(m, dict))
    elif kind is _Facts and parsed.prompt is not None:
        text = parsed.prompt if isinstance(parsed.prompt, str) else msgspec.json.encode(parsed.prompt).decode()
    if not hashes:
        return RouteFacts(session_id=session, chat_turn=turn, prefix_blocks=())
    salt = salt_of(parsed.cache_salt if isinstance(parsed.cache_salt, str) else None)
    if pool_aware is not None:
        ids = token_ids(parsed.prompt) if parsed.messages is None else None
        if ids is None:
            try:
                prompt = msgspec.json.decode(parsed.prompt)
            except _DECODE_ERRORS:
                prompt = None
            ids = pool_aware.prompt_of(prompt, parsed.messages)
        is_stream = parsed.stream is True
        return RouteFacts(
            session_id=session, chat_turn=turn, cache_salt=salt or None, prompt_ids=ids, is_stream=is_stream
        )
    return RouteFacts(session_id=session, chat_turn=turn, prefix_blocks=prefix_blocks(text, salt=salt))
