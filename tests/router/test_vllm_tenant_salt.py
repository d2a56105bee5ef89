"""The router salts each tenant's requests to vLLM replicas itself: vLLM's prefix cache and the connector's pool
namespace are keyed by cache_salt alone, and a vLLM replica sees no API key or tenant header.

The forwarded cache_salt is vllm_cache_salt(namespace_salt(tenant, client's salt)): the salt a built-in replica
derives for itself, in the form vLLM takes (no '/', NUL, at most 128 characters).
"""

import json

import pytest
from aiohttp import web

from kvshare.router.accounts import vllm_body
from kvshare.router.config import RouterConfig
from kvshare.router.server import RouterServer
from kvshare.serve.tenancy import key_tenant, namespace_salt, vllm_cache_salt
from tests.serve.live import LiveApp, call

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
ACCOUNT_KEY = "account-key-0123456789abcdef"


class _EchoReplica:
    """Answers every request with the body it received; counts what reached it."""

    def __init__(self) -> None:
        self.num_requests = 0

    def app(self) -> web.Application:
        async def echo(request: web.Request) -> web.Response:
            self.num_requests += 1
            return web.json_response({"body": (await request.read()).decode()})

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app = web.Application()
        app.router.add_get("/health", health)
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"):
            app.router.add_post(path, echo)
        return app


def _forwarded_salts(config: RouterConfig, requests: list[tuple[dict, dict]], path="/v1/completions") -> list:
    """The cache_salt (None: absent) each (headers, body) reached the replica with."""
    replica = _EchoReplica()
    with LiveApp(replica.app()) as replica_url:
        router = RouterServer(RouterConfig(**{**config.__dict__, "replicas": (replica_url,)}))
        with LiveApp(router.app()) as url:
            salts = []
            for headers, body in requests:
                status, answer = call(url, path, body, headers=headers)
                assert status == 200, answer
                salts.append(json.loads(answer["body"]).get("cache_salt"))
    return salts


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_two_tenants_get_their_own_cache_salt_whatever_they_send():
    """Fails when the router forwards vLLM bodies with the client's cache_salt (or none): the two keys' requests
    then reach vLLM with one salt, and share its prefix-cache blocks and pool pages."""
    config = RouterConfig(
        replicas=("http://127.0.0.1:1",), api_keys=(KEY_A, KEY_B), engine="vllm", account_key=ACCOUNT_KEY
    )
    requests = [
        (_bearer(key), {"prompt": "hi", **({"cache_salt": salt} if salt else {})})
        for key in (KEY_A, KEY_B)
        for salt in (None, "s-1")
    ]
    salts = _forwarded_salts(config, requests)
    assert salts == [
        vllm_cache_salt(namespace_salt(key_tenant(key), salt)) for key in (KEY_A, KEY_B) for salt in (None, "s-1")
    ]
    assert len(set(salts)) == 4  # the client's salt splits its own tenant's share, never reaches another's
    for salt in salts:  # what vLLM takes (vllm.entrypoints.generate.base.protocol.validate_cache_salt)
        assert 0 < len(salt) <= 128 and not set(salt) & set("@/\\\0"), salt
    chat = _forwarded_salts(
        config, [(_bearer(KEY_A), {"messages": [{"role": "user", "content": "hi"}]})], path="/v1/chat/completions"
    )
    assert chat == [vllm_cache_salt(key_tenant(KEY_A))]
    responses = _forwarded_salts(config, [(_bearer(KEY_A), {"input": "hi"})], path="/v1/responses")
    assert responses == [vllm_cache_salt(key_tenant(KEY_A))]  # every endpoint vLLM salts, not only completions


def test_a_client_salt_cannot_spell_another_tenants_salt():
    """Fails when the router writes the tenant's salt only where the client sent none, or passes the client's
    salt on: tenant "" (no header) sending another tenant's forwarded salt, or its name, would then share it."""
    config = RouterConfig(replicas=("http://127.0.0.1:1",), tenant_header="X-Tenant", engine="vllm")
    acme = _forwarded_salts(
        config, [({"X-Tenant": "acme"}, {"prompt": "hi"}), ({"X-Tenant": "acme"}, {"prompt": "hi", "cache_salt": "s"})]
    )
    guesses = [*acme, "acme", namespace_salt("acme", "s"), "acme\0cache_salt=s"]
    others = _forwarded_salts(
        config,
        [
            (headers, {"prompt": "hi", "cache_salt": guess})
            for guess in guesses
            for headers in ({}, {"X-Tenant": "acm"}, {"X-Tenant": "e"})
        ],
    )
    assert not set(others) & set(acme), (acme, others)
    assert _forwarded_salts(config, [({}, {"prompt": "hi"})]) == [None]  # the shared namespace: vLLM's own


def test_built_in_replicas_get_the_clients_salt_as_sent():
    """Built-in replicas salt themselves from the tenant header; the router must not salt them twice."""
    config = RouterConfig(replicas=("http://127.0.0.1:1",), api_keys=(KEY_A,), account_key=ACCOUNT_KEY)
    assert _forwarded_salts(
        config, [(_bearer(KEY_A), {"prompt": "hi", "cache_salt": "s-1"}), (_bearer(KEY_A), {"prompt": "hi"})]
    ) == ["s-1", None]


def test_vllm_replicas_without_tenants_get_the_clients_salt():
    config = RouterConfig(replicas=("http://127.0.0.1:1",), engine="vllm")
    assert _forwarded_salts(config, [({}, {"prompt": "hi", "cache_salt": "s-1"})]) == ["s-1"]


@pytest.mark.parametrize(
    "raw, param",
    [
        (b"not json", None),
        (b'["a"]', None),
        (b'{"cache_salt": ""}', "cache_salt"),
        (b'{"cache_salt": 5}', "cache_salt"),
        (b'{"prompt": NaN}', None),
        (b'{"kv_transfer_params": "x"}', "kv_transfer_params"),
    ],
)
def test_a_body_that_cannot_carry_the_tenants_salt_never_reaches_the_replica(raw, param):
    """Fails when such a body goes on as it is: a parser laxer than the router's (Python's json takes NaN)
    would give vLLM the client's own cache_salt, which may spell another tenant's."""
    replica = _EchoReplica()
    config = RouterConfig(replicas=("http://127.0.0.1:1",), api_keys=(KEY_A,), engine="vllm", account_key=ACCOUNT_KEY)
    with LiveApp(replica.app()) as replica_url:
        router = RouterServer(RouterConfig(**{**config.__dict__, "replicas": (replica_url,)}))
        with LiveApp(router.app()) as url:
            status, answer = call(url, "/v1/completions", raw=raw, headers=_bearer(KEY_A))
    assert status == 400 and answer["error"]["param"] == param, answer
    assert replica.num_requests == 0


def test_only_posts_under_v1_are_salted():
    body = b'{"prompt": "x", "cache_salt": "s"}'
    assert vllm_body("POST", "/tokenize", body, "", "", "acme") == body  # computes no KV
    assert vllm_body("GET", "/v1/models", b"", "", "", "acme") == b""
    assert json.loads(vllm_body("POST", "/v1/completions", body, "", "", "acme"))["cache_salt"] == vllm_cache_salt(
        namespace_salt("acme", "s")
    )


def test_the_engine_is_checked():
    with pytest.raises(ValueError, match="unknown engine 'sglang'"):
        RouterConfig(replicas=("http://127.0.0.1:1",), engine="sglang")
