"""What one tenant sends never shows in how the router treats another: cache_aware's prefix memory is per
tenant, the replica header is opt-in, /admin/ needs the admin key and the tokenizer endpoints an API key."""

import urllib.request
from types import SimpleNamespace

import pytest
from aiohttp import web

from kvshare.credentials import read_secret
from kvshare.router.config import RouterConfig
from kvshare.router.policy import ReplicaView
from kvshare.router.server import RouterServer
from tests.serve.live import LiveApp, call

KEY_A, KEY_B, ADMIN = "key-a-0123456789", "key-b-9876543210", "admin-key-42"
PROMPT = "A tenant's confidential preamble. " * 40  # ~1300 characters: two 512-character blocks
OTHER = "Something else entirely, of the same length. " * 30
REPLICAS = ("http://127.0.0.1:1", "http://127.0.0.1:2")


def _placements(router: RouterServer, sent: list[tuple[dict, str]]) -> list[int]:
    """The first choice of each (headers, prompt) in turn, through the router's own reading of the request."""
    views = [ReplicaView(i, True, 0) for i in range(len(REPLICAS))]
    body = lambda prompt: f'{{"model": "m", "prompt": "{prompt}"}}'.encode()
    return [router.policy.choose(router._facts(SimpleNamespace(headers=h), body(p)), views, 0.0)[0] for h, p in sent]


@pytest.mark.parametrize(
    "config, a, b",
    [
        (dict(api_keys=(KEY_A, KEY_B)), {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}),
        (dict(tenant_header="X-Tenant-ID"), {"X-Tenant-ID": "a"}, {"X-Tenant-ID": "b"}),
    ],
)
def test_tenant_b_is_placed_alike_whatever_tenant_a_sent(config, a, b):
    """Fails when the router's prefix_blocks are not seeded with the tenant identity: B's request then follows the
    replica A's prompt went to (0) where, had A sent something else, round robin would have picked 1."""
    placements = []
    for a_prompt in (PROMPT, OTHER):
        router = RouterServer(RouterConfig(replicas=REPLICAS, policy="cache_aware", **config))
        placements.append(_placements(router, [(a, a_prompt), (b, PROMPT)]))
    assert placements[0][1] == placements[1][1], placements
    # positive control: a tenant's own repeat follows its prefix
    router = RouterServer(RouterConfig(replicas=REPLICAS, policy="cache_aware", **config))
    first, again, *_ = _placements(router, [(a, PROMPT), (a, PROMPT)])
    assert first == again


def _fake_replica() -> web.Application:
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    for path in ("/v1/completions", "/tokenize", "/detokenize"):
        app.router.add_post(path, answer)
    return app


def _headers_of(url: str, path: str, headers: dict) -> dict:
    req = urllib.request.Request(url + path, data=b'{"prompt": "x"}', headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return dict(resp.headers)


def test_the_replica_header_is_sent_only_when_asked_for():
    """Fails when X-KVShare-Replica is added to every response (it tells any client where a prefix lives)."""
    with LiveApp(_fake_replica()) as replica_url:
        for expose in (False, True):
            router = RouterServer(RouterConfig(replicas=(replica_url,), expose_replica_header=expose))
            with LiveApp(router.app()) as url:
                headers = _headers_of(url, "/v1/completions", {"Content-Type": "application/json"})
            assert ("X-KVShare-Replica" in headers) is expose, headers


def test_admin_needs_the_admin_key_and_tokenizing_an_api_key():
    """Fails when /admin/drain takes any API key, or /tokenize and /detokenize go on without one."""
    a = {"Authorization": f"Bearer {KEY_A}"}
    with LiveApp(_fake_replica()) as replica_url:
        drain = {"replica": replica_url, "drain": False}
        keyed = RouterServer(RouterConfig(replicas=(replica_url,), api_keys=(KEY_A,), admin_key=ADMIN))
        with LiveApp(keyed.app()) as url:
            status, body = call(url, "/admin/drain", drain, headers=a)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", body
            assert call(url, "/admin/drain", drain, headers={"Authorization": f"Bearer {ADMIN}"})[0] == 200
            for path in ("/tokenize", "/detokenize"):
                status, body = call(url, path, {"prompt": "x"})
                assert status == 401 and body["error"]["type"] == "authentication_error", (path, body)
                assert call(url, path, {"prompt": "x"}, headers=a) == (200, {"path": path})
            assert call(url, "/admin/drain", drain, headers={"Authorization": f"Bearer {KEY_A}x"})[0] == 401
        no_admin = RouterServer(RouterConfig(replicas=(replica_url,), api_keys=(KEY_A,)))
        with LiveApp(no_admin.app()) as url:  # keys but no admin key: nobody administers, fail closed
            status, body = call(url, "/admin/drain", drain, headers=a)
            assert status == 403 and body["error"]["code"] == "admin_key_not_set", body


def test_secrets_come_from_a_file_or_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "admin.key"
    path.write_text(ADMIN + "\n")
    assert read_secret("admin key", str(path), "KVSHARE_TEST_SECRET") == ADMIN
    monkeypatch.setenv("KVSHARE_TEST_SECRET", "from-env")
    assert read_secret("admin key", "", "KVSHARE_TEST_SECRET") == "from-env"
    assert read_secret("admin key", "", "KVSHARE_TEST_UNSET_SECRET") == ""
    (tmp_path / "empty").write_text("\n")
    for bad, message in ((str(tmp_path / "empty"), "is empty"), (str(tmp_path / "nope"), "cannot read")):
        with pytest.raises(ValueError, match=message):
            read_secret("admin key", bad)
