"""The router's prefetch hints to vLLM replicas: each request is announced to the replica it is sent to, with the
token ids and cache_salt the replica's keys will be hashed from; nothing about the request itself changes."""

import threading
import time

import pytest
from aiohttp import web

from kvshare.integrations.vllm.hint_listener import HintListener
from kvshare.router.config import RouterConfig
from kvshare.router.server import RouterServer
from kvshare.serve.tenancy import vllm_cache_salt
from tests.serve.live import LiveApp, call

ACCOUNT_KEY = "account-key-0123456789abcdef"
API_KEY = "key-a-0123456789"


def _replica(bodies: list) -> web.Application:
    async def complete(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        return web.json_response({"choices": []})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    for path in ("/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, complete)
    return app


class Received:
    def __init__(self) -> None:
        self.hints, self.event = [], threading.Event()

    def on_hint(self, hint) -> None:
        self.hints.append(hint)
        self.event.set()

    def wait(self, count: int, timeout_s: float = 10) -> list:
        deadline = time.monotonic() + timeout_s
        while len(self.hints) < count and time.monotonic() < deadline:
            self.event.wait(0.05)
            self.event.clear()
        return self.hints


@pytest.fixture
def hinted(tmp_path):
    """Two fake vLLM replicas behind a router whose hints go to replica 0's listener (replica 1 takes none)."""
    received, bodies = Received(), []
    path = str(tmp_path / "r0.sock")
    listener = HintListener(path, ACCOUNT_KEY, received.on_hint, lambda why: None)
    listener.start()
    try:
        with LiveApp(_replica(bodies)) as r0, LiveApp(_replica(bodies)) as r1:
            config = RouterConfig(
                replicas=(r0, r1),
                engine="vllm",
                policy="round_robin",
                account_key=ACCOUNT_KEY,
                api_keys=(API_KEY,),
                hint_addresses=(path, ""),
                model="tiny",
            )
            with LiveApp(RouterServer(config).app()) as url:
                time.sleep(0.3)  # the hint connection opens with the router
                yield url, received, bodies
    finally:
        listener.close()


def _post(url: str, path: str, body: dict) -> None:
    status, answer = call(url, path, body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200, answer


def test_a_prompt_of_token_ids_is_hinted_to_its_replica_with_the_salt_it_carries(hinted):
    url, received, bodies = hinted
    ids = list(range(5, 905))
    _post(url, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 2})  # replica 0
    _post(url, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 2})  # replica 1: no address
    (hint,) = received.wait(1)
    assert hint.tokens().tolist() == ids and hint.model == "tiny"
    salt = vllm_cache_salt(_tenant_salt())
    assert hint.cache_salt == salt and salt.encode() in bodies[0]  # the salt of the body the replica got
    time.sleep(0.3)
    assert len(received.hints) == 1


def test_a_chat_is_hinted_with_the_ids_of_its_rendered_prompt(hinted):
    url, received, _ = hinted
    from kvshare.router.prompt_ids import placer_tokenizer, prompt_ids

    messages = [{"role": "user", "content": "Sharing a prefix across replicas. " * 40}]
    _post(url, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 2})
    (hint,) = received.wait(1)
    assert hint.tokens().tolist() == list(prompt_ids(placer_tokenizer("tiny"), None, messages))


def test_hint_addresses_need_vllm_replicas_the_account_key_and_one_per_replica():
    base = dict(replicas=("http://a:1", "http://b:2"), engine="vllm", account_key=ACCOUNT_KEY)
    RouterConfig(**base, hint_addresses=("/x/a.sock", ""))
    for changes, why in (
        ({"hint_addresses": ("/x/a.sock",)}, "one --hint-address per --replica"),
        ({"hint_addresses": ("/x/a.sock", ""), "account_key": ""}, "account-key-file"),
        ({"hint_addresses": ("/x/a.sock", ""), "engine": "builtin"}, "vLLM replicas"),
        ({"hint_addresses": ("relative.sock", "")}, "absolute path or HOST:PORT"),
    ):
        with pytest.raises(ValueError, match=why):
            RouterConfig(**{**base, **changes})


def _tenant_salt() -> str:
    from kvshare.serve.tenancy import namespace_salt, tenant_identity

    return namespace_salt(tenant_identity(API_KEY, ""), None)
