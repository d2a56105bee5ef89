"""The streaming client against a fake OpenAI server: what it times and what it reads."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvshare.bench import client as client_module
from kvshare.bench.client import (
    BenchRequest,
    Response,
    absorb,
    event_data,
    model_name,
    send,
    split_events,
    step_top_logprobs,
)
from tests.bench.fake_server import SEEN, fake_app


def test_split_events_keeps_the_incomplete_rest():
    events, rest = split_events(b"data: 1\n\ndata: 2\r\n\r\ndata: 3")
    assert events == [b"data: 1", b"data: 2"] and rest == b"data: 3"
    assert event_data(b": a comment") is None
    assert event_data(b"data: [DONE]") == "[DONE]"


def test_absorb_times_the_first_token_not_the_first_chunk():
    r = Response()
    absorb(r, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.1)
    absorb(r, {"choices": [{"delta": {"content": "a"}}]}, 0.3)
    assert r.first_chunk_s == 0.1 and r.ttft_s == 0.3 and r.first_text_s == 0.3 and r.text == "a"


def test_token_ids_accumulate_over_chunks():
    """vLLM sends each chunk's own token ids; kvshare sends all of them in the final chunk."""
    r = Response()
    for ids in ([5], [6, 7], []):
        absorb(r, {"choices": [{"text": "", "token_ids": ids}]}, 0.1)
    assert r.token_ids == [5, 6, 7]


def test_a_token_without_text_counts_through_its_logprobs():
    r = Response()
    absorb(r, {"choices": [{"text": "", "logprobs": {"tokens": [""], "token_logprobs": [-2.0]}}]}, 0.2)
    absorb(r, {"choices": [{"text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": [-1.0]}}]}, 0.4)
    assert (r.ttft_s, r.first_text_s) == (0.2, 0.4)


def test_top_logprobs_of_both_shapes_accumulate_per_token():
    r = Response()
    absorb(
        r,
        {
            "choices": [
                {
                    "text": "",
                    "logprobs": {"tokens": ["a"], "token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1, "b": -2.0}]},
                }
            ]
        },
        0.1,
    )
    absorb(
        r,
        {
            "choices": [
                {
                    "text": "",
                    "logprobs": {"tokens": ["c"], "token_logprobs": [-0.3], "top_logprobs": [{"c": -0.3, "d": -0.4}]},
                }
            ]
        },
        0.2,
    )
    assert r.top_logprobs == [[-0.1, -2.0], [-0.3, -0.4]]
    chat = Response()
    absorb(
        chat,
        {
            "choices": [
                {
                    "delta": {"content": "a"},
                    "logprobs": {
                        "content": [
                            {
                                "token": "a",
                                "logprob": -0.1,
                                "top_logprobs": [{"token": "a", "logprob": -0.1}, {"token": "a", "logprob": -0.7}],
                            }
                        ]
                    },
                }
            ]
        },
        0.1,
    )
    assert chat.top_logprobs == [[-0.1, -0.7]]  # a list: candidates of the same text both stay


def test_completion_candidates_of_the_same_text_keep_the_gap_through_the_chosen_logprob():
    """Synthetic presets: most ids decode to nothing, so top-1 and top-2 share the key ""; the entry left
    holds the lower logprob (servers fill the mapping in rank order) and the chosen token's is the top-1."""
    merged = {"tokens": ["", ""], "token_logprobs": [-0.2, -0.5], "top_logprobs": [{"": -0.9}, {"": -0.5}]}
    steps = step_top_logprobs(merged)
    assert steps[0] == [-0.2, -0.9]
    assert steps[1] == [-0.5]  # equal to the chosen one: the second is unknown, no tie is invented
    assert step_top_logprobs({"tokens": [""], "token_logprobs": [-0.2], "top_logprobs": [None]}) == [[]]
    assert step_top_logprobs({"tokens": ["x"], "token_logprobs": [-0.2]}) == []  # logprobs: 0 sends no top


async def _with_server(app, fn):
    server = TestServer(app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            return await fn(session, str(server.make_url("")))
    finally:
        await server.close()


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_send_reads_stream_provenance_and_token_ids(kind):
    app = fake_app(first_token_delay_s=0.1)

    async def go(session, url):
        request = BenchRequest(
            url,
            kind,
            "fake-model",
            prompt=[1, 2] if kind == "completion" else None,
            messages=[{"role": "user", "content": "hi"}] if kind == "chat" else None,
            max_tokens=3,
            use_pool=False,
            session_id="s1",
        )
        return await send(session, request), await model_name(session, url)

    response, name = asyncio.run(_with_server(app, go))
    assert name == "fake-model"
    assert response.error is None
    assert response.text == "Hello" and response.token_ids == [1, 2, 3]
    assert response.provenance == {"replica": "fake0", "local_tokens": 0, "pool_tokens": 256, "computed_tokens": 44}
    assert response.prompt_tokens == 300 and response.cached_tokens == 256 and response.completion_tokens == 3
    assert response.routed_to == "http://fake"
    # the first content came after the delay and after the empty chunks; the end after that
    assert 0.1 <= response.first_chunk_s < response.ttft_s < response.first_text_s <= response.e2e_s
    assert response.ttft_s >= 0.12
    sent = app[SEEN][0]
    assert sent["body"]["kvshare"] == {"use_pool": False, "use_local_cache": True}
    assert sent["body"]["stream"] is True and sent["body"]["temperature"] == 0.0
    assert sent["body"]["return_token_ids"] is True and sent["session"] == "s1"
    # every token in a chunk of its own (the first is seen even without text), with its top-2 logprobs
    if kind == "completion":
        assert sent["body"]["logprobs"] == 2
    else:
        assert sent["body"]["logprobs"] is True and sent["body"]["top_logprobs"] == 2
    assert response.top_logprobs == [[-1.0, -1.5]]  # the one token the fake server sends logprobs for


def test_no_extension_is_sent_when_use_pool_is_none():
    app = fake_app(first_token_delay_s=0.0)

    async def go(session, url):
        return await send(session, BenchRequest(url, "completion", "m", prompt=[1], use_pool=None))

    asyncio.run(_with_server(app, go))
    assert "kvshare" not in app[SEEN][0]["body"]


def test_http_errors_and_unreachable_servers_come_back_as_errors():
    async def go(session, url):
        return await send(session, BenchRequest(url, "completion", "m", prompt=[1]))

    response = asyncio.run(_with_server(fake_app(status=400), go))
    assert response.error.startswith("HTTP 400") and response.ttft_s is None

    async def unreachable():
        async with aiohttp.ClientSession() as session:
            return await send(session, BenchRequest("http://127.0.0.1:9", "completion", "m", prompt=[1]), timeout_s=5)

    response = asyncio.run(unreachable())
    assert response.error and response.ttft_s is None and response.e2e_s >= 0


def test_requests_check_their_kind():
    with pytest.raises(ValueError):
        BenchRequest("http://x", "completion", "m", messages=[])
    with pytest.raises(ValueError):
        BenchRequest("http://x", "embedding", "m", prompt=[1])


@pytest.mark.parametrize("library", ["openai", "aiohttp"])
def test_a_users_client_sends_the_same_chat_and_reads_the_same_stream(library, monkeypatch):
    """Text through /v1/chat/completions as a user's client: the openai SDK where installed, else aiohttp;
    the same body, provenance, token ids and top-2 logprobs either way."""
    if library == "openai":
        pytest.importorskip("openai")
    else:
        monkeypatch.setattr(client_module, "openai_version", lambda: None)
    app = fake_app(first_token_delay_s=0.05)

    async def go(session, url):
        request = BenchRequest(
            url,
            "chat",
            "fake-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            use_pool=True,
            session_id="s1",
            is_user_client=True,
        )
        return await send(session, request)

    response = asyncio.run(_with_server(app, go))
    assert response.error is None, response.error
    assert response.text == "Hello" and response.token_ids == [1, 2, 3]
    assert response.provenance["pool_tokens"] == 256 and response.cached_tokens == 256
    assert response.routed_to == "http://fake" and response.top_logprobs == [[-1.0, -1.5]]
    assert 0.05 <= response.ttft_s <= response.e2e_s
    sent = app[SEEN][0]
    assert sent["path"] == "/v1/chat/completions" and sent["session"] == "s1"
    body = sent["body"]
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["kvshare"]["use_pool"] is True
    assert body["return_token_ids"] is True and body["ignore_eos"] is True and body["top_logprobs"] == 2


def test_a_users_client_sends_text_only():
    with pytest.raises(ValueError, match="chat messages"):
        BenchRequest("http://x", "completion", "m", prompt=[1], is_user_client=True)
