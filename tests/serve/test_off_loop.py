"""A long text prompt is encoded off the replica's event loop (kvshare.serve.off_loop): while it is encoded, the
replica's other requests are answered; a short one stays on the loop; errors are the request's as before."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request

import pytest

from kvshare.serve.off_loop import OFF_LOOP_MIN_CHARS, off_loop
from tests.serve.live import call, replica, tiny_engine

LONG_TEXT = "Which words does a replica run? " * (OFF_LOOP_MIN_CHARS // 32 + 1)  # ~4.1k byte tokens: tiny takes it


@pytest.fixture(scope="module")
def engine():
    engine = tiny_engine()
    yield engine
    engine.close()


class BlockedEncode:
    """The tokenizer's encode_array held on an Event for texts of ``OFF_LOOP_MIN_CHARS`` or more."""

    def __init__(self, encode) -> None:
        self.encode = encode
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, text: str):
        if len(text) < OFF_LOOP_MIN_CHARS:
            return self.encode(text)
        self.entered.set()
        self.release.wait(120)
        try:
            return self.encode(text)
        finally:
            self.returned.set()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": "tiny", "prompt": LONG_TEXT, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 1},
        ),
    ],
)
def test_health_is_answered_while_a_long_text_prompt_is_encoded(engine, monkeypatch, path, body):
    """Fails when the completion or chat handler encodes the text on the event loop (server.py calling
    ``encode_array`` directly, as before ``off_loop``): /health then waits behind the blocked encode and its
    read times out."""
    tok = engine.tokenizer
    expected = len(tok.apply_chat_template(body["messages"]) if "messages" in body else tok.encode(LONG_TEXT))
    blocked = BlockedEncode(engine.tokenizer.encode_array)
    monkeypatch.setattr(engine.tokenizer, "encode_array", blocked)
    answers = {}
    with replica(engine) as url:
        sender = threading.Thread(target=lambda: answers.update(long=call(url, path, body)))
        sender.start()
        try:
            assert blocked.entered.wait(60), "the long text never reached the tokenizer"
            with urllib.request.urlopen(url + "/health", timeout=30) as resp:
                health = resp.status, json.loads(resp.read())
            is_still_encoding = not blocked.returned.is_set()
        finally:
            blocked.release.set()
            sender.join(120)
    assert health[0] == 200 and health[1]["replica"] == "replica0"
    assert is_still_encoding
    status, answer = answers["long"]
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == expected


def test_a_long_chat_whose_template_cannot_render_is_the_requests_400(engine, monkeypatch):
    """The template is rendered on the loop before the encode hop: its error stays the request's 400."""
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{{ raise_exception('no system role') }}")
    with replica(engine) as url:
        status, answer = call(
            url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": LONG_TEXT}]}
        )
    assert status == 400 and "cannot render" in answer["error"]["message"], answer


def test_a_short_text_runs_on_the_loop_and_a_long_one_on_a_thread_with_its_exception():
    async def run() -> tuple[int, int, int]:
        here = threading.get_ident()
        short = await off_loop(threading.get_ident, num_chars=OFF_LOOP_MIN_CHARS - 1)
        long = await off_loop(threading.get_ident, num_chars=OFF_LOOP_MIN_CHARS)
        with pytest.raises(ValueError, match="bad prompt"):
            await off_loop(_raise, ValueError("bad prompt"), num_chars=OFF_LOOP_MIN_CHARS)
        return here, short, long

    here, short, long = asyncio.run(run())
    assert short == here and long != here


def _raise(exc: Exception):
    raise exc
