"""Logprobs bodies (kvshare.serve.responses): byte tokens keep distinct names and their raw bytes."""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.engine.tokenizer import EOS_ID, Tokenizer
from kvshare.serve.responses import chat_logprobs, completion_logprobs, token_name

TOK = Tokenizer.byte_level(64)


@dataclass
class Event:
    token_id: int
    logprob: float
    top_logprobs: dict


def test_tokens_that_split_a_character_are_named_by_their_bytes():
    assert token_name(TOK, 0xE4) == ("bytes:\\xe4", b"\xe4")  # OpenAI's spelling of a partial character
    assert token_name(TOK, ord("a")) == ("a", b"a")
    assert token_name(TOK, EOS_ID) == ("<|eos|>", b"<|eos|>")  # special tokens by their text, as in vLLM
    # ids beyond the tokenizer's vocabulary (a synthetic preset's larger model vocabulary) have no text
    assert token_name(TOK, 5000) == ("token_id:5000", None)


def test_completion_top_logprobs_keep_every_byte_token():
    events = [
        Event(0xE4, -0.5, {0xE4: -0.5, 0xE5: -1.0, 0xE6: -2.0, EOS_ID: -3.0, 258: -4.0}),
        Event(0xBD, -0.1, {0xBD: -0.1, 0xBE: -3.0}),
        Event(0xA0, -0.2, {0xA0: -0.2}),
    ]
    body = completion_logprobs(TOK, events)
    assert body["tokens"] == ["bytes:\\xe4", "bytes:\\xbd", "bytes:\\xa0"]
    # before the fix the three bytes all decoded to U+FFFD and the two special tokens to "": 2 keys, not 5
    assert body["top_logprobs"][0] == {
        "bytes:\\xe4": -0.5,
        "bytes:\\xe5": -1.0,
        "bytes:\\xe6": -2.0,
        "<|eos|>": -3.0,
        "<|im_start|>": -4.0,
    }
    assert len(body["top_logprobs"][1]) == 2
    assert body["text_offset"] == [0, 0, 0]  # the three bytes make one character, which starts at 0


def test_text_offsets_count_characters_of_the_text():
    events = (
        [Event(i, -1.0, {}) for i in b"ab"] + [Event(EOS_ID, -1.0, {})] + [Event(i, -1.0, {}) for i in "é!".encode()]
    )
    assert completion_logprobs(TOK, events)["text_offset"] == [0, 1, 2, 2, 2, 3]


def test_chat_bytes_are_the_tokens_raw_bytes():
    events = [Event(0xE4, -0.5, {0xE4: -0.5, 0xE5: -1.0}), Event(ord("x"), -0.1, {ord("x"): -0.1})]
    content = chat_logprobs(TOK, events)["content"]
    assert content[0]["token"] == "bytes:\\xe4" and content[0]["bytes"] == [0xE4]  # not U+FFFD's [239, 191, 189]
    assert [t["bytes"] for t in content[0]["top_logprobs"]] == [[0xE4], [0xE5]]
    assert content[1] == {
        "token": "x",
        "logprob": -0.1,
        "bytes": [120],
        "top_logprobs": [{"token": "x", "logprob": -0.1, "bytes": [120]}],
    }
    unknown = chat_logprobs(TOK, [Event(5000, -0.3, {5000: -0.3, 5001: -0.4})])["content"][0]
    assert unknown["bytes"] is None and [t["token"] for t in unknown["top_logprobs"]] == [
        "token_id:5000",
        "token_id:5001",
    ]
