"""Hostile and unusual request bodies on a replica and through the router: every one answered 4xx in the
OpenAI error shape, never a 500 or a traceback."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.router.proxy import RouterConfig, RouterServer
from kvshare.serve import api_types as A
from tests.serve.live import LiveApp, call, replica, tiny_engine

ERROR_FIELDS = {"message", "type", "param", "code"}


def nested(depth: int, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    return opener * depth + b"1" + closer * depth


def bodies_nested_at(depth: int) -> list[tuple[str, bytes]]:
    """(path, body): nesting in the prompt, in a parameter decoded as any JSON, in chat messages."""
    deep_list, deep_object = nested(depth), nested(depth, b'{"a":', b"}")
    return [("/v1/completions", b'{"prompt": ' + deep_list + b"}"),
            ("/v1/completions", b'{"prompt": "x", "guided_json": ' + deep_object + b"}"),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + deep_list + b"}]}"),
            ("/v1/chat/completions", b'{"messages": [], "tools": ' + deep_object + b"}"),
            ("/tokenize", b'{"prompt": ' + deep_list + b"}")]


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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 50_000), width=st.integers(0, 2_000),
       shape=st.sampled_from(["list", "object", "prompt", "messages", "mixed"]))
def test_body_parsers_answer_any_depth_and_size_with_an_api_error(depth, width, shape):
    """Fails when a RecursionError (or any exception but ApiError) escapes the body parsers."""
    deep = nested(depth) if shape != "object" else nested(depth, b'{"a":', b"}")
    if shape == "mixed":
        deep = b'[{"a":' * (depth // 2) + b"1" + b"}]" * (depth // 2)
    padding = b", " + b", ".join(b"%d" % i for i in range(width)) if width else b""
    for body in (deep, b'{"prompt": [' + deep + padding + b"]}", b'{"prompt": "x", "stop": ' + deep + b"}",
                 b'{"messages": [{"role": "user", "content": "x", "name": ' + deep + b"}]}",
                 b'{"prompt": [1' + padding + b"], \"logit_bias\": " + deep + b"}"):
        _decode_any(body)
