"""The router names each completion's pool account for vLLM replicas, signed, whatever the client wrote there.

A vLLM replica sees no API key or tenant header of its own, so its connector charges the pool quota to
``kv_transfer_params["kvshare"]["account"]`` when the router's tag under the shared key is valid
(kvshare.integrations.vllm.options.TransferParams). A client must never choose its account.
"""

import dataclasses
import json

import pytest
from aiohttp import web

from kvshare.integrations.vllm.options import TransferParams
from kvshare.router.accounts import vllm_body
from kvshare.router.config import RouterConfig
from kvshare.router.server import RouterServer
from kvshare.serve.tenancy import account_identity, account_tag, key_tenant
from tests.serve.live import LiveApp, call

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
ACCOUNT_KEY = "account-key-0123456789abcdef"


def _echo_replica() -> web.Application:
    """Answers every request with the body it received, as JSON."""

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"body": (await request.read()).decode()})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        app.router.add_post(path, echo)
    return app


def _forwarded(url: str, path: str, body: dict, headers: dict) -> dict:
    status, answer = call(url, path, body, headers=headers)
    assert status == 200, answer
    return json.loads(answer["body"])


FORGED_ENTRY = {"use_pool": False, "account": "victim", "account_tag": account_tag("guessed-key-0000", "victim")}
FORGED = {
    "prompt": "hello",
    "cache_salt": "s-1",
    "max_tokens": 3,
    "kv_transfer_params": {"other": [1, 2], "kvshare": FORGED_ENTRY},
}


def test_a_client_sent_account_is_replaced_by_the_authenticated_one():
    """Fails when the router forwards the body as the client sent it: the replica then reads the client's
    account ("victim", a tag under another key), or when the client's kvshare entry wins over the router's."""
    config = RouterConfig(
        replicas=("http://127.0.0.1:1",), api_keys=(KEY_A, KEY_B), tenant_header="X-Tenant", account_key=ACCOUNT_KEY
    )
    with LiveApp(_echo_replica()) as replica_url:
        router = RouterServer(dataclasses.replace(config, replicas=(replica_url,)))
        with LiveApp(router.app()) as url:
            for path in ("/v1/completions", "/v1/chat/completions"):
                for team in ("red", "blue", ""):  # a key's holder may send any tenant header: one account
                    headers = {"Authorization": f"Bearer {KEY_A}"} | ({"X-Tenant": team} if team else {})
                    sent = _forwarded(url, path, FORGED, headers)
                    ours = sent["kv_transfer_params"]["kvshare"]
                    assert ours["account"] == key_tenant(KEY_A) == account_identity(KEY_A, team), sent
                    params = TransferParams.from_params(sent["kv_transfer_params"], ACCOUNT_KEY)
                    assert params == TransferParams(use_pool=False, account=key_tenant(KEY_A)), sent
                    # the rest of the body goes on as the client sent it
                    assert sent["kv_transfer_params"]["other"] == [1, 2], sent
                    assert {k: sent[k] for k in ("prompt", "cache_salt", "max_tokens")} == {
                        "prompt": "hello",
                        "cache_salt": "s-1",
                        "max_tokens": 3,
                    }
            other = _forwarded(url, "/v1/completions", {"prompt": "x"}, {"Authorization": f"Bearer {KEY_B}"})
            assert TransferParams.from_params(other["kv_transfer_params"], ACCOUNT_KEY).account == key_tenant(KEY_B)
            tokenized = _forwarded(url, "/tokenize", {"prompt": "x"}, {"Authorization": f"Bearer {KEY_B}"})
            assert tokenized == {"prompt": "x"}  # stores no KV: not rewritten


def test_without_an_account_key_the_body_goes_on_untouched():
    with LiveApp(_echo_replica()) as replica_url:
        router = RouterServer(RouterConfig(replicas=(replica_url,), tenant_header="X-Tenant"))
        with LiveApp(router.app()) as url:
            sent = _forwarded(url, "/v1/completions", FORGED, {"X-Tenant": "acme"})
    assert sent == FORGED  # and a replica with no key (or another) takes no account from it
    assert TransferParams.from_params(sent["kv_transfer_params"], ACCOUNT_KEY).account is None


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"kv_transfer_params": "x"}', b""])
def test_a_body_the_replica_refuses_goes_on_as_it_is(body):
    assert vllm_body("POST", "/v1/completions", body, ACCOUNT_KEY, "a", None) == body


def test_an_empty_kv_transfer_params_gets_the_account():
    tag = account_tag(ACCOUNT_KEY, "a")
    for body in (
        b'{"prompt": "x"}',
        b'{"prompt": "x", "kv_transfer_params": null}',
        b'{"prompt": "x", "kv_transfer_params": {"kvshare": 3}}',
    ):
        assert json.loads(vllm_body("POST", "/v1/completions", body, ACCOUNT_KEY, "a", None)) == {
            "prompt": "x",
            "kv_transfer_params": {"kvshare": {"account": "a", "account_tag": tag}},
        }


def test_the_account_key_must_be_long_enough():
    with pytest.raises(ValueError, match="at least 16 characters"):
        RouterConfig(replicas=("http://127.0.0.1:1",), account_key="short")
