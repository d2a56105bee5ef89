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
    """The tokenizer's encode step (``encode_missing``) held on an Event when ``OFF_LOOP_MIN_CHARS`` or more
    characters are left to encode."""

    def __init__(self, encode_missing) -> None:
        self.encode_missing = encode_missing
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, lookup):
        if lookup.num_missing_chars < OFF_LOOP_MIN_CHARS:
            return self.encode_missing(lookup)
        self.entered.set()
        self.release.wait(120)
        try:
            return self.encode_missing(lookup)
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
    ``encode_array`` directly, as before ``prompt_array``): /health then waits behind the blocked encode and its
    read times out."""
    tok = engine.tokenizer
    expected = len(tok.apply_chat_template(body["messages"]) if "messages" in body else tok.encode(LONG_TEXT))
    blocked = BlockedEncode(engine.tokenizer.encode_missing)
    monkeypatch.setattr(engine.tokenizer, "encode_missing", blocked)
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


def test_a_text_whose_pieces_are_cached_pays_no_hop_and_its_next_turn_none_for_a_short_tail():
    """The presets' BPE: a 26k-character text no cache holds is encoded on a thread; the same text again, and
    the text with a short tail, are joined on the loop from the cache (fails when ``prompt_array`` decides by the
    text's length instead of what is left to encode: the cached text then hops too)."""
    from kvshare.engine.loader import load_tokenizer
    from kvshare.serve.tokenize import prompt_array

    tok = load_tokenizer("qwen3-8b")
    words = " ".join(tok.decode([i]).strip() for i in range(100_000, 105_000))
    text = (words + " ")[:26_000]  # its last piece (from its third cut, ~24.6k) and a tail: < 4096 to encode
    encoded_on = []
    encode_missing = tok.encode_missing

    def spy(lookup):
        encoded_on.append(threading.get_ident())
        return encode_missing(lookup)

    tok.encode_missing = spy

    async def run():
        first = await prompt_array(tok, text)
        again = await prompt_array(tok, text)
        turn = await prompt_array(tok, text + " and then? " * 10)
        return threading.get_ident(), first, again, turn

    loop_thread, first, again, turn = asyncio.run(run())
    assert encoded_on[0] != loop_thread and encoded_on[1:] == [loop_thread, loop_thread]
    assert first.tolist() == again.tolist() == tok._pieces.plain(text)
    assert turn.tolist() == tok._pieces.plain(text + " and then? " * 10)


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
