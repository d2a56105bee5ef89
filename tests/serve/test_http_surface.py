"""Hostile and unusual request bodies on a replica and through the router: every one answered 4xx in the
OpenAI error shape, never a 500 or a traceback."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.router.config import RouterConfig
from kvshare.router.server import RouterServer
from kvshare.serve import api_types as A
from tests.serve.live import LiveApp, call, replica, tiny_engine

ERROR_FIELDS = {"message", "type", "param", "code"}


def nested(depth: int, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    return opener * depth + b"1" + closer * depth


def bodies_nested_at(depth: int) -> list[tuple[str, bytes]]:
    """(path, body): nesting in the prompt, in a parameter decoded as any JSON, in chat messages."""
    deep_list, deep_object = nested(depth), nested(depth, b'{"a":', b"}")
    return [
        ("/v1/completions", b'{"prompt": ' + deep_list + b"}"),
        ("/v1/completions", b'{"prompt": "x", "guided_json": ' + deep_object + b"}"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + deep_list + b"}]}"),
        ("/v1/chat/completions", b'{"messages": [], "tools": ' + deep_object + b"}"),
        ("/tokenize", b'{"prompt": ' + deep_list + b"}"),
    ]


@pytest.fixture(scope="module")
def urls():
    """(router URL, replica URL): the router reads prompts (cache_aware), so it parses every body too."""
    with replica(tiny_engine()) as replica_url:
        router = RouterServer(RouterConfig(replicas=(replica_url,), policy="cache_aware", health_interval_s=0.2))
        with LiveApp(router.app()) as router_url:
            yield router_url, replica_url


def test_deeply_nested_json_is_a_400_in_the_openai_shape(urls):
    """Fails when the parsers let msgspec's RecursionError through (a plain-text 500 from aiohttp)."""
    for url in urls:
        for path, body in bodies_nested_at(100_000):
            status, out = call(url, path, raw=body)
            assert status == 400, (url, path, status, out)
            # a typed field stops the decode early (invalid_value); an untyped one reaches the nesting limit
            assert set(out["error"]) == ERROR_FIELDS and out["error"]["code"] in ("invalid_json", "invalid_value")
    status, out = call(urls[0], "/admin/drain", raw=b'{"replica": ' + nested(100_000) + b"}")
    assert status == 400 and set(out["error"]) == ERROR_FIELDS


def _decode_any(body: bytes) -> None:
    for decode in (A.decode_completion, lambda b: A.decode(b, A.ChatRequest)):
        try:
            A.validate(decode(body))
        except A.ApiError as exc:
            assert 400 <= exc.status < 500 and set(exc.body()["error"]) == ERROR_FIELDS


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    depth=st.integers(1, 20_000),
    width=st.integers(0, 500),
    shape=st.sampled_from(["list", "object", "prompt", "messages", "mixed"]),
)
def test_body_parsers_answer_any_depth_and_size_with_an_api_error(depth, width, shape):
    """Fails when a RecursionError (or any exception but ApiError) escapes the body parsers."""
    deep = nested(depth) if shape != "object" else nested(depth, b'{"a":', b"}")
    if shape == "mixed":
        deep = b'[{"a":' * (depth // 2) + b"1" + b"}]" * (depth // 2)
    padding = b", " + b", ".join(b"%d" % i for i in range(width)) if width else b""
    for body in (
        deep,
        b'{"prompt": [' + deep + padding + b"]}",
        b'{"prompt": "x", "stop": ' + deep + b"}",
        b'{"messages": [{"role": "user", "content": "x", "name": ' + deep + b"}]}",
        b'{"prompt": [1' + padding + b'], "logit_bias": ' + deep + b"}",
    ):
        _decode_any(body)


def chat_body(**extra) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}).encode()


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [3]]}, "prompt"),
    ],
)
def test_parameters_not_implemented_are_refused_as_unsupported_alike(urls, path, body, param):
    """Fails when n, echo or a batch of prompts is refused with code null."""
    answers = [call(url, path, body) for url in urls]
    assert answers[0] == answers[1]
    status, out = answers[0]
    assert status == 400 and out["error"]["code"] == "unsupported_parameter" and out["error"]["param"] == param


def test_top_logprobs_without_logprobs_is_refused_as_vllm_does(urls):
    """Fails when top_logprobs without logprobs is served without logprobs (vLLM answers 400)."""
    status, out = call(urls[1], "/v1/chat/completions", raw=chat_body(top_logprobs=2))
    assert status == 400 and out["error"]["param"] == "top_logprobs"
    assert out["error"]["message"] == "when using `top_logprobs`, `logprobs` must be set to true."
    assert call(urls[1], "/v1/chat/completions", raw=chat_body(top_logprobs=0))[0] == 200
    assert call(urls[1], "/v1/chat/completions", raw=chat_body(top_logprobs=2, logprobs=True))[0] == 200


def test_a_model_is_retrieved_by_its_name(urls):
    """Fails when GET /v1/models/{id} (openai's models.retrieve) is a 404 for the served name."""
    for url in urls:
        status, card = call(url, "/v1/models/tiny")
        assert status == 200 and card["id"] == "tiny" and card["object"] == "model"
        status, out = call(url, "/v1/models/other")
        assert status == 404 and out["error"]["code"] == "model_not_found"


def stream_offsets(url: str, **body) -> list[int]:
    import urllib.request

    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    offsets = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp.read().split(b"\n\n"):
            if line.startswith(b"data: {"):
                choice = json.loads(line[len(b"data: ") :])["choices"][0]
                offsets += (choice.get("logprobs") or {}).get("text_offset", [])
    return offsets


def test_streamed_text_offsets_run_on_as_in_the_whole_answer(urls):
    """Fails when each streamed chunk's text_offset restarts at 0."""
    body = {"prompt": "once upon a time", "max_tokens": 8, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    status, whole = call(urls[1], "/v1/completions", body)
    expected = whole["choices"][0]["logprobs"]["text_offset"]
    assert status == 200 and len(expected) == 8 and expected[-1] > 0
    for url in urls:
        assert stream_offsets(url, stream=True, **body) == expected


def test_router_and_replica_answer_a_malformed_body_with_the_same_code(urls):
    """Fails when the router's own endpoint answers malformed JSON with another code than a replica's."""
    router_url, replica_url = urls
    drained = call(router_url, "/admin/drain", raw=b"{not json")
    completion = call(replica_url, "/v1/completions", raw=b"{not json")
    assert drained[0] == completion[0] == 400 and drained[1]["error"]["code"] == completion[1]["error"]["code"]
    status, out = call(router_url, "/admin/drain", {"replica": 3})
    assert status == 400 and out["error"]["param"] == "replica" and out["error"]["code"] == "invalid_value"
