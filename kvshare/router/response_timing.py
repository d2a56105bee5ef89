"""A relayed response as pool_aware measures it: when its first byte came and when it ended, and from its end
the prompt tokens its replica computed and loaded from the pool (the final chunk's ``kvshare`` object; a vLLM
replica's unstreamed body carries it in ``kv_transfer_params``; else the usage a vLLM stream ends with, split by
what the placement knew: kvshare.router.placement.split_cached). ``ResponseTiming.end`` gives one sample to the
calibration (kvshare.router.calibration) and what the replica's local cache held to the sent memory."""

from __future__ import annotations

import time
from collections import deque

import msgspec

from kvshare.router.calibration import Calibration
from kvshare.router.vllm_usage import UsageStrip

MAX_TAIL_BYTES = 64 << 10  # the end of a stream kept to read its final chunk's provenance


class _Provenance(msgspec.Struct):
    computed_tokens: int | None = None
    pool_tokens: int | None = None
    local_tokens: int | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None


class _Final(msgspec.Struct):
    kvshare: _Provenance | None = None  # the built-in replica's
    kv_transfer_params: dict | None = None  # a vLLM replica's: its "kvshare" entry (unstreamed bodies only)
    usage: _Usage | None = None  # a vLLM stream's usage chunk


def provenance_of(tail: bytes) -> tuple[int, int] | None:
    """(computed tokens, pool tokens) from the end of a response (an SSE stream or one JSON body), the last
    ``kvshare`` object in it; None where the replica withheld it or the tail holds none whole."""
    p = _provenance(tail)
    return None if p is None else (p.computed_tokens, p.pool_tokens)


def usage_of(tail: bytes) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) from the last usage in the end of a response that counts both (vLLM's,
    with ``--enable-prompt-tokens-details``); None where there is none."""
    for final in _finals(tail, b'"usage"'):
        usage = final.usage
        details = None if usage is None else usage.prompt_tokens_details
        if details is not None and usage.prompt_tokens is not None and details.cached_tokens is not None:
            return usage.prompt_tokens, details.cached_tokens
    return None


def _provenance(tail: bytes) -> _Provenance | None:
    for final in _finals(tail, b"kvshare"):
        p = final.kvshare
        params = final.kv_transfer_params
        if p is None and params is not None and isinstance(params.get("kvshare"), dict):
            try:
                p = msgspec.convert(params["kvshare"], _Provenance, strict=False)
            except msgspec.ValidationError:
                continue
        if p is not None and p.computed_tokens is not None and p.pool_tokens is not None:
            return p
    return None


def _finals(tail: bytes, marker: bytes):
    """The JSON bodies (one body, or each event of a stream) in ``tail`` that hold ``marker``, newest first."""
    bodies = (
        [tail]
        if not tail.lstrip().startswith(b"data:") and b"\n\ndata:" not in tail
        else [event.strip()[len(b"data:") :] for event in tail.split(b"\n\n") if event.strip().startswith(b"data:")]
    )
    for body in reversed(bodies):
        if marker in body:
            try:
                yield msgspec.json.decode(body, type=_Final)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue


class ResponseTiming:
    """A relayed response's times and end, for ``Calibration.observe``: ``piece`` for each piece as it arrives,
    ``end`` once it ended whole (``pieces`` does both around an upstream response)."""

    def __init__(
        self,
        calibration: Calibration,
        replica: int,
        sent_s: float,
        is_stream: bool,
        on_local=None,
        split=None,
        is_usage_asked: bool = False,
    ) -> None:
        self.calibration, self.replica, self.sent_s, self.is_stream = calibration, replica, sent_s, is_stream
        self.on_local = on_local  # called with the tokens the replica had in its local cache, where it says
        self.split = split  # (prompt tokens, cached tokens) -> (computed, pool) or None: for a usage-only response
        self.is_usage_asked = is_usage_asked  # the router asked for the usage chunk: the client gets none
        self.first_byte_s: float | None = None
        self.on_first_byte = lambda: None  # the send's: the request's prefill is done (kvshare.router.backlog)
        self.is_prefill_shared = lambda: False  # the send's: its prefill overlapped another's (BacklogEntry)
        self._tail: deque[bytes] = deque()
        self._tail_bytes = 0

    async def pieces(self, upstream):
        """The pieces of an aiohttp ClientResponse's body as they arrive, timed (without a usage chunk the router
        asked for: kvshare.router.vllm_usage); a 200 read to its end is observed (one left early, or that
        failed, is not)."""
        is_stripped = self.is_usage_asked and self.is_stream and upstream.status == 200
        strip = UsageStrip() if is_stripped else None
        async for data in upstream.content.iter_any():
            self.piece(data, time.monotonic())
            data = data if strip is None else strip.feed(data)
            if data:
                yield data
        if strip is not None and (rest := strip.close()):
            yield rest
        if upstream.status == 200:
            self.end(time.monotonic())

    def piece(self, data: bytes, now: float) -> None:
        if self.first_byte_s is None and data:
            self.first_byte_s = now
            self.on_first_byte()
        self._tail.append(data)
        self._tail_bytes += len(data)
        while self._tail_bytes - len(self._tail[0]) >= MAX_TAIL_BYTES:
            self._tail_bytes -= len(self._tail.popleft())

    def end(self, now: float) -> None:
        tail = b"".join(self._tail)
        p = _provenance(tail)
        counts = None if p is None else (p.computed_tokens, p.pool_tokens)
        usage = usage_of(tail) if counts is None and self.split is not None else None
        if usage is not None:
            counts = self.split(*usage)
        computed, pool = (None, None) if counts is None else counts
        first_byte_s = self.first_byte_s if self.is_stream else None
        self.calibration.observe(self.replica, self.sent_s, first_byte_s, now, computed, pool, self.is_prefill_shared())
        if self.on_local is not None and p is not None and p.local_tokens is not None and p.local_tokens >= 0:
            self.on_local(p.local_tokens)
