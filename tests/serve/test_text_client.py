"""The bench client's user mode (text through /v1/chat/completions, the body encoded inside the clock) against a
real replica: the prompt it runs is the chat template's rendering of the messages, the ids /tokenize names."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvshare.bench import client as client_module
from kvshare.bench.client import BenchRequest, send
from tests.serve.live import call, replica, tiny_engine

MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Which words does a replica run? " * 30 + "Naïve café, 東京."},
]


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine()
    yield engine
    engine.close()


async def _send(url: str, request_kind: str, **extra):
    async with aiohttp.ClientSession() as session:
        return await send(session, BenchRequest(url, request_kind, "tiny", max_tokens=3, use_pool=False, **extra))


@pytest.mark.parametrize("library", ["openai", "aiohttp"])
def test_a_users_text_runs_the_rendered_chat_of_the_tokenize_endpoint(engine, library, monkeypatch):
    """Fails when the ids a chat runs are not the chat template's rendering of its messages encoded (e.g. the
    rendered text changed by one trailing space), or when the user mode's stream is not read through."""
    if library == "openai":
        pytest.importorskip("openai")
    else:
        monkeypatch.setattr(client_module, "openai_version", lambda: None)
    with replica(engine, provenance="all") as url:
        status, tokenized = call(url, "/tokenize", {"model": "tiny", "messages": MESSAGES})
        assert status == 200, tokenized
        chat = asyncio.run(_send(url, "chat", messages=MESSAGES, is_user_client=True))
        ids = asyncio.run(_send(url, "completion", prompt=tokenized["tokens"]))
    assert chat.error is None and ids.error is None, (chat.error, ids.error)
    assert tokenized["tokens"] == engine.tokenizer.apply_chat_template(MESSAGES)
    assert chat.prompt_tokens == tokenized["count"] == ids.prompt_tokens
    assert chat.completion_tokens == 3 and chat.token_ids == ids.token_ids  # the same prompt, greedy
    assert chat.provenance["computed_tokens"] + chat.provenance["local_tokens"] == tokenized["count"]
