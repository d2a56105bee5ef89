"""benchmarks/vs_vllm.py's client: one streamed greedy request as a user's client sends it (token ids through
/v1/completions, or chat text through /v1/chat/completions by kvshare's bench client), the chat prompts, the
client's warm-up and each request's replica timeline."""

from __future__ import annotations

import asyncio
import functools
import json
import urllib.request


def text_client_refusal() -> str | None:
    """None when kvshare's bench client has a user's mode (``BenchRequest.is_user_client``: chat text through
    /v1/chat/completions, the body built and encoded inside the clock); else why ``--client text`` cannot run."""
    from dataclasses import fields

    from kvshare.bench import client

    if "is_user_client" in {f.name for f in fields(client.BenchRequest)}:
        return None
    return (
        "--client text needs kvshare's bench client to send chat text as a user's client does "
        "(kvshare.bench.client.BenchRequest.is_user_client); this tree's client has no such mode: "
        "run with --client token_ids"
    )


async def _send(url, model, prompt, max_tokens: int, use_pool: bool | None, client: str, timeline: bool = False):
    import aiohttp

    from kvshare.bench.client import BenchRequest, send

    common = dict(url=url, model=model, max_tokens=max_tokens, use_pool=use_pool, timeline=timeline)
    if client == "text":  # chat messages through a user's client (text_client_refusal says it exists)
        request = BenchRequest(kind="chat", messages=prompt, is_user_client=True, **common)
    else:
        request = BenchRequest(kind="completion", prompt=prompt, **common)
    async with aiohttp.ClientSession() as session:
        return await send(session, request)


def request(url, model, prompt, max_tokens: int, use_pool: bool | None, client: str = "token_ids", timeline=False):
    """One streamed greedy request through kvshare's bench client (``prompt``: token ids, or chat messages for
    ``client`` text; ``timeline``: a kvshare replica's steps to the first token, in its provenance); a failed
    request ends the run."""
    response = asyncio.run(_send(url, model, prompt, max_tokens, use_pool, client, timeline))
    if response.error:
        raise RuntimeError(f"a request to {url} failed: {response.error}")
    return response


_WARM_CLIENTS: set[tuple[str, str]] = set()


def warm_client(url: str, model: str, client: str, model_dir: str, seed: int, use_pool: bool | None) -> None:
    """Before a server's first text prompt, one short chat request through the user's client (a prompt that shares
    nothing with the measured ones): the openai SDK's first call in a process pays its lazy imports and set-up
    inside the clock (1.0 s on the GPU machine), which a user's long-lived client pays once, not per request. The
    server's own first chat request costs what its later ones do (its timelines)."""
    if client != "text" or (url, client) in _WARM_CLIENTS:
        return
    request(url, model, chat_prompt(model_dir, seed, 256, "vs-vllm/warm-up"), 2, use_pool, client)
    _WARM_CLIENTS.add((url, client))


def chat_prompt(model_dir: str, seed: int, num_tokens: int, tag: str) -> list[dict]:
    """Chat messages whose rendered prompt (the model's chat template) is exactly ``num_tokens`` tokens."""
    return prompt_factory(model_dir, seed).chat_messages(num_tokens, tag)


@functools.lru_cache(maxsize=2)
def prompt_factory(model_dir: str, seed: int):
    from kvshare.bench.workload import PromptFactory, WorkloadConfig
    from kvshare.engine.tokenizer import Tokenizer

    return PromptFactory(Tokenizer.from_dir(model_dir), WorkloadConfig(nonce=f"vs-vllm-{seed}", seed=seed))


def served_model(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def timelines(cold, cross, locals_) -> dict:
    """Each request's steps to its first token, as its replica timed them (``--timelines``)."""

    def of(response):
        return (response.provenance or {}).get("timeline")

    return {"cold": of(cold), "cross": of(cross), "local": [of(r) for r in locals_]}
