"""Which of the requests the router forwards it hints to the vLLM replica it sends them to, and with which ids.

A completion or chat forwarded to a vLLM replica that has a hint address is announced to it as it is sent
(``Dispatch.send_to``: each replica the relay tries), as a ``PrefetchHint`` (kvshare.router.hints) of the prompt's
token ids, the cache_salt of the body the replica gets and the model it asks for. The ids are those the router has
already: a prompt of token ids, or pool_aware's (its tokenizer's). Where it has a tokenizer and the prompt is a text
or a chat, the ids are encoded off the loop and the hint follows when they are in: the request itself never waits
for a hint. A prompt whose ids cannot be had is not announced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from kvshare.router.accounts import ACCOUNT_PATHS
from kvshare.router.facts import token_ids
from kvshare.router.hint_sender import HintSender
from kvshare.router.hints import make_hint
from kvshare.router.prompt_ids import KnownPrefix, prompt_ids

log = logging.getLogger("kvshare.router")
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


class _HintBody(msgspec.Struct):
    """What a hint reads of the forwarded body: the prompt kept as its JSON bytes until its form is known."""

    model: object = None
    prompt: msgspec.Raw = msgspec.Raw(b"null")
    messages: list[dict] | None = None
    cache_salt: object = None


class PrefetchHints:
    """Announces forwarded requests to their replicas through ``sender``; ``tokenizer``: the replicas' (None: only
    prompts whose ids the router has are announced)."""

    def __init__(self, sender: HintSender, tokenizer=None) -> None:
        self.sender, self.tokenizer = sender, tokenizer
        self._pending: set[asyncio.Task] = set()

    def announcer(self, method: str, path: str, body: bytes, known_ids=None) -> Callable[[int], None] | None:
        """What to call with each replica the request is sent to (None: nothing to announce). ``body``: the body
        the replica gets; ``known_ids``: the prompt's token ids where placement had them (pool_aware)."""
        if method != "POST" or path not in ACCOUNT_PATHS:
            return None
        try:
            parsed = msgspec.json.decode(body, type=_HintBody)
        except _DECODE_ERRORS:
            return None  # the replica answers it
        model = parsed.model if isinstance(parsed.model, str) else ""
        salt = parsed.cache_salt if isinstance(parsed.cache_salt, str) else None
        ids = known_ids.ids if isinstance(known_ids, KnownPrefix) else known_ids
        if ids is None and parsed.messages is None:
            ids = token_ids(parsed.prompt)
        if ids is None and self.tokenizer is None:
            return None

        def announce(replica: int) -> None:
            if not self.sender.takes_hints(replica):
                return
            if ids is not None:
                self._send(replica, model, salt, ids)
                return
            task = asyncio.get_running_loop().create_task(self._encoded(replica, model, salt, parsed))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

        return announce

    def _send(self, replica: int, model: str, salt: str | None, ids) -> None:
        try:
            hint = make_hint(model, salt, ids)
        except ValueError as exc:  # ids beyond u32: the replica refuses the request itself
            log.debug("no hint for a request: %s", exc)
            return
        self.sender.send(replica, hint)

    async def _encoded(self, replica: int, model: str, salt: str | None, parsed: _HintBody) -> None:
        """Encode a text or chat prompt off the loop, then send its hint (late hints still shorten a load)."""
        from kvshare.serve.off_loop import off_loop

        try:
            prompt = msgspec.json.decode(parsed.prompt)
        except _DECODE_ERRORS:
            return
        size = len(prompt) if isinstance(prompt, str) else sum(len(str(m)) for m in parsed.messages or ())
        ids = await off_loop(prompt_ids, self.tokenizer, prompt, parsed.messages, num_chars=size)
        if ids is not None:
            self._send(replica, model, salt, ids)

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await self.sender.close()
