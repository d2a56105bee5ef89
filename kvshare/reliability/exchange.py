"""One request of the load tool: send, read the stream or body, report what came back (never raises)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvshare.bench.client import Response, absorb, event_data, split_events


@dataclass
class Outcome:
    """A request's result: status, times from sending (s), token ids, provenance, or what went wrong."""

    status: int = 0  # HTTP status; 0: no response (connection refused or reset before one)
    e2e_s: float = 0.0
    ttft_s: float | None = None
    text: str = ""
    token_ids: list[int] | None = None
    prompt_tokens: int | None = None
    provenance: dict | None = None
    replica: str | None = None
    error: str | None = None  # None: a complete, well-formed answer
    num_bytes: int = 0  # of the response body as received
    top_logprobs: list[dict] = field(default_factory=list)  # reference answers: top-2 per step

    @property
    def is_ok(self) -> bool:
        return self.error is None


async def post(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float
) -> Outcome:
    out = Outcome()
    started = time.perf_counter()
    try:
        async with session.post(
            url.rstrip("/") + path, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            out.status = resp.status
            if resp.status != 200:
                raw = await resp.read()
                out.num_bytes = len(raw)
                out.error = f"HTTP {resp.status}: {raw.decode(errors='replace')[:300]}"
            elif body.get("stream"):
                await _read_stream(resp, out, started)
            else:
                raw = await resp.read()
                out.num_bytes = len(raw)
                _read_body(json.loads(raw), out)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    out.e2e_s = time.perf_counter() - started
    return out


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome, started: float) -> None:
    got = Response()
    buffer, is_done = b"", False
    async for piece in resp.content.iter_any():
        out.num_bytes += len(piece)
        buffer += piece
        events, buffer = split_events(buffer)
        for event in events:
            data = event_data(event)
            if data == "[DONE]":
                is_done = True
            elif data is not None:
                absorb(got, json.loads(data), time.perf_counter() - started)
    out.ttft_s, out.text, out.token_ids = got.ttft_s, got.text, got.token_ids
    out.prompt_tokens, out.provenance, out.replica = (
        got.prompt_tokens,
        got.provenance,
        (got.provenance or {}).get("replica"),
    )
    if got.error is not None:
        out.error = f"error in stream: {got.error}"[:300]
    elif not is_done or got.finish_reason is None:
        out.error = "the stream ended before its last chunk"  # e.g. the replica died mid-stream
    elif got.token_ids is None:
        out.error = "the stream carried no token ids (is this a kvshare replica?)"


def _read_body(data: dict, out: Outcome) -> None:
    choice = (data.get("choices") or [{}])[0]
    out.token_ids = choice.get("token_ids")
    out.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
    out.prompt_tokens = (data.get("usage") or {}).get("prompt_tokens")
    out.provenance = data.get("kvshare")
    out.replica = (out.provenance or {}).get("replica")
    out.top_logprobs = _top_logprobs(choice.get("logprobs"))
    if out.token_ids is None:
        out.error = "the answer carried no token ids (is this a kvshare replica?)"


def _top_logprobs(logprobs: dict | None) -> list[dict]:
    """Per generated step, {token: logprob} of the top candidates (completion or chat format)."""
    if not logprobs:
        return []
    if "top_logprobs" in logprobs:  # completions
        return [dict(step or {}) for step in logprobs["top_logprobs"] or []]
    return [
        {c["token"]: c["logprob"] for c in step.get("top_logprobs") or []} for step in logprobs.get("content") or []
    ]
