"""Sampling parameters and logprobs through a replica's HTTP API.

Every parameter changes the answer the way vLLM's does, or is refused with a 400 naming it;
none is accepted and ignored. In-process replica (tests/serve/live.py), the tiny model.
"""

from __future__ import annotations

import pytest

from kvshare.serve import api_types as A
from tests.serve.live import call, replica, tiny_engine

PROMPT = "The sampling test prompt"


@pytest.fixture(scope="module")
def url():
    with replica(tiny_engine()) as address:
        yield address


def complete(url, **body):
    status, out = call(
        url,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True} | body,
    )
    assert status == 200, out
    return out["choices"][0]


def chat(url, **body):
    return call(
        url,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "ignore_eos": True} | body,
    )


def test_top_k_one_and_min_p_one_equal_greedy(url):
    greedy = complete(url, temperature=0)["token_ids"]
    assert complete(url, temperature=1.0, top_k=1, seed=5)["token_ids"] == greedy
    assert complete(url, temperature=1.0, min_p=1.0, seed=5)["token_ids"] == greedy
    assert complete(url, temperature=1.0, seed=5)["token_ids"] != greedy  # the control: sampling differs


def test_logit_bias_forces_and_bans_tokens(url):
    forced = complete(url, temperature=1.0, seed=1, logit_bias={"65": 100})
    assert forced["token_ids"] == [65] * 12 and forced["text"] == "A" * 12
    greedy = complete(url, temperature=0)["token_ids"]
    banned = complete(url, temperature=0, logit_bias={str(greedy[0]): -100})["token_ids"]
    assert banned[0] != greedy[0]
    status, err = call(url, "/v1/completions", {"prompt": PROMPT, "logit_bias": {"999999": 5}})
    assert status == 400 and err["error"]["param"] == "logit_bias"


def test_stop_token_ids_end_with_stop_and_leave_the_token_out_of_the_text(url):
    greedy = complete(url, temperature=0)
    stop_at = greedy["token_ids"][3]
    first = greedy["token_ids"].index(stop_at)
    stopped = complete(url, temperature=0, stop_token_ids=[stop_at])
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == greedy["token_ids"][: first + 1]
    # the byte tokenizer: one byte per token; the stop token's own text is left out, as vLLM does
    assert stopped["text"] == bytes(greedy["token_ids"][:first]).decode(errors="replace")
    status, err = call(url, "/v1/completions", {"prompt": PROMPT, "stop_token_ids": [10**6]})
    assert status == 400 and err["error"]["param"] == "stop_token_ids"


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}]
)
def test_penalties_change_greedy_output_away_from_seen_tokens(url, penalty):
    greedy = complete(url, temperature=0, max_tokens=60)["token_ids"]
    penalised = complete(url, temperature=0, max_tokens=60, **penalty)["token_ids"]
    assert penalised != greedy
    step = next(i for i, (a, b) in enumerate(zip(greedy, penalised)) if a != b)
    seen = set(greedy[:step]) | (set(PROMPT.encode()) if "repetition_penalty" in penalty else set())
    assert greedy[step] in seen  # only tokens seen before are penalised


@pytest.mark.parametrize(
    "path, name, value",
    [
        ("/v1/completions", "best_of", 3),
        ("/v1/completions", "suffix", "!"),
        ("/v1/completions", "response_format", {"type": "json_object"}),
        ("/v1/completions", "guided_regex", "a+"),
        ("/v1/chat/completions", "guided_json", {"type": "object"}),
        ("/v1/chat/completions", "guided_choice", ["a"]),
        ("/v1/chat/completions", "guided_grammar", "root ::= 'a'"),
        ("/v1/chat/completions", "structured_outputs", {"choice": ["a"]}),
        ("/v1/chat/completions", "bad_words", ["x"]),
        ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("/v1/chat/completions", "tool_choice", {"type": "function", "function": {"name": "f"}}),
        (
            "/v1/chat/completions",
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
        ),
    ],
)
def test_unimplemented_parameters_get_400_naming_them(url, path, name, value):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, err = call(url, path, base | {name: value, "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == name and name in err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == "unsupported_parameter"


def test_image_parts_get_400_and_neutral_values_are_served(url):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    status, err = chat(url, messages=[{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}])
    assert status == 400 and err["error"]["param"] == "messages[0].content[1].type"
    status, out = chat(
        url,
        temperature=0,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        frequency_penalty=0,
        presence_penalty=0,
        best_of=None,
    )
    assert status == 200 and out["usage"]["completion_tokens"] == 4
    status, plain = chat(url, temperature=0)
    assert out["choices"][0]["message"] == plain["choices"][0]["message"]  # neutral values change nothing


@pytest.mark.parametrize("name", sorted(set(A.UNSUPPORTED_COMMON) | set(A.UNSUPPORTED_CHAT)))
def test_every_refused_chat_parameter_is_refused_over_http(url, name):
    status, err = chat(url, **{name: "not-neutral"})
    assert status == 400 and err["error"]["param"] == name


def test_completion_top_logprobs_keep_byte_tokens_apart(url):
    out = complete(url, temperature=0, max_tokens=8, logprobs=5)
    tops = out["logprobs"]["top_logprobs"]
    # the tiny model's vocabulary is bytes: half of them (0x80..0xff) decode to U+FFFD alone, so in most steps
    # two of the five most likely did; each used to overwrite the other in the dict
    assert sum(any(key.startswith("bytes:") for key in top) for top in tops) >= 2
    assert [len(top) for top in tops] == [5] * 8  # five tokens asked for, five keys in every step
    for token_id, name in zip(out["token_ids"], out["logprobs"]["tokens"]):  # (no special token under ignore_eos here)
        assert name == (chr(token_id) if token_id < 128 else f"bytes:\\x{token_id:02x}")


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(url):
    status, out = chat(
        url, temperature=0, max_tokens=3, logprobs=True, top_logprobs=5, logit_bias={"228": 100}, return_token_ids=True
    )
    assert status == 200
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["bytes:\\xe4"] * 3 and [c["bytes"] for c in content] == [[228]] * 3
    for step in content:  # every alternative named apart, its bytes its own
        names = [t["token"] for t in step["top_logprobs"]]
        assert len(names) == len(set(names)) == 5
        for t in step["top_logprobs"]:
            if t["token"].startswith("bytes:"):
                assert t["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in t["bytes"])
            else:
                assert bytes(t["bytes"]).decode() == t["token"]


@pytest.mark.parametrize("ids", [[1, -5, 2], [1, 10**6], [2**64 - 1], [10**20]])
def test_token_ids_outside_the_vocabulary_get_400(url, ids):
    status, out = call(url, "/v1/completions", {"prompt": ids, "max_tokens": 2})
    assert status == 400, out
    assert out["error"]["param"] == "prompt" and "token ids must lie in" in out["error"]["message"]
    assert complete(url, prompt=[1, 2, 3])["token_ids"]  # and the replica serves the next request


def test_token_ids_read_as_an_array_serve_as_the_list_did(url):
    """A token-id prompt is read into one array; spaced or compact, the answer and the
    prompt_token_ids returned are the same, and the same as the text prompt's ids give."""
    ids = complete(url, max_tokens=1)["prompt_token_ids"]
    compact = complete(url, prompt=ids, temperature=0)
    raw = (
        '{"prompt": [ ' + " ,\n ".join(map(str, ids)) + ' ], "max_tokens": 12, "ignore_eos": true, '
        '"return_token_ids": true, "temperature": 0}'
    ).encode()
    status, spaced = call(url, "/v1/completions", raw=raw)
    assert status == 200, spaced
    assert spaced["choices"][0]["token_ids"] == compact["token_ids"] == complete(url, temperature=0)["token_ids"]
    assert spaced["choices"][0]["prompt_token_ids"] == compact["prompt_token_ids"] == ids


@pytest.mark.parametrize("raw", [b'{"prompt": [], "max_tokens": 2}', b'{"prompt": [ \n ], "max_tokens": 2}'])
def test_an_empty_token_id_prompt_gets_400(url, raw):
    status, out = call(url, "/v1/completions", raw=raw)
    assert status == 400 and out["error"]["param"] == "prompt" and "empty" in out["error"]["message"], out


def test_errors_name_the_field_the_request_used(url):
    """Fails when max_completion_tokens' errors name max_tokens, or a message without a role is reported as
    param "role" where every other field is named by its whole path (messages[0].content)."""
    status, out = chat(url, max_tokens=None, max_completion_tokens=-3)
    assert status == 400 and out["error"]["param"] == "max_completion_tokens", out
    assert "max_completion_tokens" in out["error"]["message"], out
    status, out = chat(url, max_tokens=-3)
    assert status == 400 and out["error"]["param"] == "max_tokens", out
    status, out = chat(url, messages=[{"content": "hello"}])
    assert status == 400 and out["error"]["param"] == "messages[0].role", out
    status, out = chat(url, messages=[{"role": "user", "content": 5}])
    assert status == 400 and out["error"]["param"] == "messages[0].content", out
    status, out = chat(url, kvshare={"bogus": True})
    assert status == 400 and out["error"]["param"] == "kvshare.bogus", out


def test_max_tokens_is_bounded_by_the_context_not_a_fixed_cap(url):
    """Fails when max_tokens above 8192 is refused on a model whose context is 32768 (vLLM bounds it by the
    context alone). Token 65 is forced and is a stop token, so the answer is one token long."""
    forced = {"logit_bias": {"65": 100}, "stop_token_ids": [65], "ignore_eos": False, "temperature": 1.0}
    status, out = call(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20000} | forced)
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop", out
    status, out = chat(url, max_tokens=None, max_completion_tokens=20000, **forced)
    assert status == 200, out
    status, out = call(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40000})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded", out
    assert out["error"]["param"] == "max_tokens", out
