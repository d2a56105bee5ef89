"""A streaming OpenAI client that times what a user sees: first content token and end of response.

One request at a time (the experiments measure an idle system). Works against any
OpenAI-compatible server; kvshare replicas add provenance (the ``kvshare`` object of
the final chunk) and, with ``return_token_ids``, the generated token ids (vLLM returns
them too). Every request asks for the top-2 logprobs of each generated token: the gap
between them says whether a differing output parted at a near tie (kvshare.outputs).
A user's client (``is_user_client``: text through /v1/chat/completions) builds and encodes
its body inside the clock, through the openai SDK where installed, else the same request
through aiohttp; the SDK is never imported by ``import kvshare``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

TOP_LOGPROBS = 2  # per generated token: enough for the top-1 minus top-2 gap


@dataclass(frozen=True)
class BenchRequest:
    """One request: where to send it and what it asks."""

    url: str  # the server's base URL
    kind: str  # "completion" (prompt = token ids) | "chat" (messages)
    model: str
    prompt: list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int = 16
    use_pool: bool | None = True  # None: send no kvshare extension (servers that lack it)
    use_local_cache: bool = True
    session_id: str | None = None  # the X-Session-ID header (routers place sessions by it)
    # Logprobs asked for: every generated token then arrives in a chunk of its own, text or not (a
    # token that decodes to nothing (a special token, a partial UTF-8 sequence, or an id beyond a
    # synthetic model's tokenizer) would otherwise send no chunk, and its time would not be seen),
    # and the top 2 give the gap at a divergence. Every request of every condition asks the same,
    # so the one top-2 selection per step costs every condition alike. None: ask for no logprobs.
    num_top_logprobs: int | None = TOP_LOGPROBS
    timeline: bool = False  # ask a kvshare replica for the request's timeline (in the provenance object)
    # a user's client: the body is built and JSON-encoded inside the clock, through the openai SDK where it is
    # installed (as an application does); False: encoded before the clock (a load generator's own cost)
    is_user_client: bool = False
    # where the extension goes: "builtin" (kvshare replicas: the body's ``kvshare`` object) or "vllm" (vLLM with
    # kvshare's connector: ``use_pool`` in kv_transfer_params["kvshare"]; vLLM has no timeline, and no switch for
    # its prefix cache, so ``use_local_cache=False`` needs a ``cache_salt`` of the request's own)
    engine: str = "builtin"
    cache_salt: str | None = None  # vLLM's field (kvshare replicas take it too): keys no other salt matches

    def __post_init__(self) -> None:
        if self.kind not in ("completion", "chat"):
            raise ValueError(f"unknown request kind {self.kind!r}")
        if (self.kind == "completion") != (self.prompt is not None) or (self.kind == "chat") != (
            self.messages is not None
        ):
            raise ValueError("a completion request takes prompt ids, a chat request takes messages")
        if self.is_user_client and self.kind != "chat":
            raise ValueError("a user's client sends chat messages (text)")
        if self.engine not in ("builtin", "vllm"):
            raise ValueError(f"unknown engine {self.engine!r}; choose builtin or vllm")
        if self.engine == "vllm" and not self.use_local_cache and self.cache_salt is None:
            raise ValueError("vLLM's prefix cache has no per-request switch: give the request a cache_salt of its own")

    def body(self) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if self.kind == "completion":
            body["prompt"] = self.prompt
            if self.num_top_logprobs is not None:
                body["logprobs"] = self.num_top_logprobs
        else:
            body["messages"] = self.messages
            if self.num_top_logprobs is not None:
                body["logprobs"], body["top_logprobs"] = True, self.num_top_logprobs
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        if self.use_pool is not None and self.engine == "vllm":
            body["kv_transfer_params"] = {"kvshare": {"use_pool": self.use_pool}}
        elif self.use_pool is not None:
            body["kvshare"] = {"use_pool": self.use_pool, "use_local_cache": self.use_local_cache}
            if self.timeline:
                body["kvshare"]["timeline"] = True
        return body

    @property
    def path(self) -> str:
        return "/v1/completions" if self.kind == "completion" else "/v1/chat/completions"


@dataclass
class Response:
    """What came back, with client-side times in seconds from sending the request."""

    ttft_s: float | None = None  # first chunk that carries a generated token (text, or its logprob)
    first_text_s: float | None = None  # first chunk that carries text
    first_chunk_s: float | None = None  # first data chunk of any kind
    e2e_s: float = 0.0
    text: str = ""
    token_ids: list[int] | None = None
    top_logprobs: list[list[float]] = field(default_factory=list)  # per generated token (see step_top_logprobs)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    provenance: dict | None = None  # the kvshare object: replica, local/pool/computed tokens
    routed_to: str | None = None  # X-KVShare-Replica header of a kvshare router
    finish_reason: str | None = None
    error: str | None = None
    events: int = field(default=0, repr=False)


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete server-sent events in ``buffer`` (separated by a blank line) and the rest."""
    buffer = buffer.replace(b"\r\n", b"\n")
    *events, rest = buffer.split(b"\n\n")
    return events, rest


def event_data(event: bytes) -> str | None:
    """The data of one event (its ``data:`` lines joined), or None for comments and empty events."""
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines).decode() if lines else None


def absorb(response: Response, chunk: dict, now_s: float) -> None:
    """Fold one stream chunk (completion or chat) into ``response``."""
    if "error" in chunk:
        response.error = str(chunk["error"].get("message", chunk["error"]))
        return
    if response.first_chunk_s is None:
        response.first_chunk_s = now_s
    for choice in chunk.get("choices") or []:
        piece = choice.get("text")
        if piece is None:
            piece = (choice.get("delta") or {}).get("content")
        logprobs = choice.get("logprobs") or {}
        has_token = bool(piece) or bool(logprobs.get("tokens") or logprobs.get("content"))
        response.top_logprobs += step_top_logprobs(logprobs)
        if has_token and response.ttft_s is None:
            response.ttft_s = now_s
        if piece:
            if response.first_text_s is None:
                response.first_text_s = now_s
            response.text += piece
        if choice.get("token_ids") is not None:  # kvshare: all of them in the final chunk; vLLM: each chunk's own
            response.token_ids = (response.token_ids or []) + list(choice["token_ids"])
        if choice.get("finish_reason"):
            response.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage:
        response.prompt_tokens = usage.get("prompt_tokens")
        response.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        response.cached_tokens = details.get("cached_tokens")
    if chunk.get("kvshare"):
        response.provenance = dict(chunk["kvshare"])


def step_top_logprobs(logprobs: dict) -> list[list[float]]:
    """The top logprob values of each generated token in one chunk's ``logprobs`` (completion or chat shape).

    The completion shape keys a step's top logprobs by token *text*: two candidates that decode
    to the same text (both to nothing, say, as most ids of a synthetic preset do) leave one entry.
    The servers (kvshare, vLLM) build that mapping in rank order, so the entry left holds the
    lower logprob; the chosen token's own logprob (``token_logprobs``: at temperature 0, the top-1)
    supplies the other. Only a value strictly below the chosen one is taken as the second: an
    entry equal to it leaves the second unknown rather than inventing a tie.
    """
    if "content" in logprobs:  # chat: candidates are a list, nothing merges
        return [
            [float(c["logprob"]) for c in (step.get("top_logprobs") or []) if c.get("logprob") is not None]
            for step in logprobs.get("content") or []
        ]
    tops = logprobs.get("top_logprobs") or []
    chosen = logprobs.get("token_logprobs") or []
    steps = []
    for i, top in enumerate(tops):
        values = [float(v) for v in (top or {}).values() if v is not None]
        mine = chosen[i] if i < len(chosen) else None
        if len(values) == 1 and mine is not None and values[0] < float(mine):
            values = [float(mine)] + values
        steps.append(values)
    return steps


async def send(session: aiohttp.ClientSession, request: BenchRequest, timeout_s: float = 3600.0) -> Response:
    """Send one streaming request and time it; failures are returned in ``error``, never raised."""
    if request.is_user_client and openai_version() is not None:
        return await _send_openai(request, timeout_s)
    response = Response()
    headers = {"X-Session-ID": request.session_id} if request.session_id else {}
    headers["Content-Type"] = "application/json"
    started = time.perf_counter()
    if request.is_user_client:  # as the SDK does (httpx's json=): stdlib json, inside the clock
        data = json.dumps(request.body()).encode()
    else:  # before the clock: a load generator's own JSON encoding (~20 ms for 128k token ids) is not the service's
        data = msgspec.json.encode(request.body())
        started = time.perf_counter()
    try:
        async with session.post(
            request.url.rstrip("/") + request.path,
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            response.routed_to = resp.headers.get("X-KVShare-Replica")
            if resp.status != 200:
                response.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return response
            buffer = b""
            async for piece in resp.content.iter_any():
                buffer += piece
                events, buffer = split_events(buffer)
                for event in events:
                    data = event_data(event)
                    if data is None or data == "[DONE]":
                        continue
                    response.events += 1
                    absorb(response, json.loads(data), time.perf_counter() - started)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        response.error = f"{type(exc).__name__}: {exc}"
    finally:
        response.e2e_s = time.perf_counter() - started
    if response.error is None and response.first_chunk_s is None:
        response.error = "the stream ended without a chunk"
    return response


def openai_version() -> str | None:
    """The installed openai SDK's version (the user's client of text requests), None without it."""
    try:
        import openai
    except ImportError:
        return None
    return openai.__version__


_SDK_ARGUMENTS = (
    "model",
    "messages",
    "max_tokens",
    "temperature",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
)


async def _send_openai(request: BenchRequest, timeout_s: float) -> Response:
    """``send`` through the openai SDK's streaming chat call; the rest of the body goes in ``extra_body``."""
    import openai

    response = Response()
    client = openai.AsyncOpenAI(
        base_url=request.url.rstrip("/") + "/v1", api_key="kvshare-bench", max_retries=0, timeout=timeout_s
    )
    headers = {"X-Session-ID": request.session_id} if request.session_id else None
    started = time.perf_counter()
    try:
        body = request.body()
        arguments = {name: body.pop(name) for name in _SDK_ARGUMENTS if name in body}
        raw = await client.chat.completions.with_raw_response.create(
            **arguments, extra_body=body, extra_headers=headers
        )
        response.routed_to = raw.headers.get("X-KVShare-Replica")
        async for chunk in raw.parse():
            response.events += 1
            absorb(response, chunk.to_dict(), time.perf_counter() - started)
    except openai.APIStatusError as exc:
        response.error = f"HTTP {exc.status_code}: {str(exc)[:500]}"
    except (openai.APIError, OSError, ValueError) as exc:
        response.error = f"{type(exc).__name__}: {exc}"
    finally:
        response.e2e_s = time.perf_counter() - started
        await client.close()
    if response.error is None and response.first_chunk_s is None:
        response.error = "the stream ended without a chunk"
    return response


async def model_name(session: aiohttp.ClientSession, url: str) -> str:
    """The first model a server lists at /v1/models."""
    async with session.get(url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
        resp.raise_for_status()
        data = await resp.json()
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"{url} lists no models at /v1/models")
    return models[0]["id"]
