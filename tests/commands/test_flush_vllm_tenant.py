"""``pool-admin flush --replica URL --tenant T`` where URL is a vLLM replica with kvshare's connector.

A vLLM server has no /admin/namespace: its connector keys a tenant's requests by the cache_salt the router
writes (kvshare.router.accounts), and names a request's namespace in kv_transfer_params. The replica here is
the connector's scheduler side behind a small HTTP server that answers as vLLM does (no vLLM needed); the
pages are stored through the connector's own sides into a real pool.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvshare.keys import namespace_digest
from kvshare.pool.client import PoolClient
from kvshare.router.accounts import replica_salt
from kvshare.serve.tenancy import tenant_identity
from tests.commands.test_errors import kvshare, refused
from tests.integrations.vllm.pool_replicas import NAMESPACE, PROMPT, Replica, pool_fixture  # noqa: F401
from tests.integrations.vllm.test_cache_salt import prefill

CHUNKS = 4  # PROMPT's full chunks


class _VllmLike(BaseHTTPRequestHandler):
    """vLLM's OpenAI server as far as pool-admin asks it: a model list, completions, 404 for the rest."""

    replica: Replica | None = None  # None: a vLLM server without kvshare's connector
    served = 0

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._answer(404, {"detail": "Not Found"})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).served += 1
        params = None
        if self.replica is not None:  # what KVShareConnector does with the request, in vLLM's order
            s, req_id = self.replica.scheduler, f"probe-{self.served}"
            s.add_request(req_id, body["prompt"], body.get("cache_salt"), body.get("kv_transfer_params"))
            assert s.match(req_id, 0) == 0  # the pool is off for it: no lookup
            params = {"kvshare": s.finish(req_id)}  # request_finished's kv_transfer_params
        self._answer(
            200, {"object": "text_completion", "choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params}
        )


@pytest.fixture
def vllm_like(pool):  # noqa: F811
    replica = Replica(pool, "A", seed=1)
    handler = type("Handler", (_VllmLike,), {"replica": replica, "served": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield replica, handler, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        replica.close()


def namespaces(pool) -> dict[bytes, int]:
    with PoolClient(pool, name="test") as client:
        return {n.namespace: n.num_entries for n in client.list_namespaces().namespaces}


def test_flush_by_tenant_finds_a_vllm_replicas_namespace_of_that_tenant_only(pool, vllm_like):  # noqa: F811
    """Fails without the vLLM path: pool-admin asked only /admin/namespace, which a vLLM server answers 404,
    so tenant A's pages stored by a vLLM replica survived ``flush --tenant A``."""
    replica, handler, url = vllm_like
    salt = {t: replica_salt("vllm", tenant_identity("", t), None) for t in ("acme", "other")}  # as the router salts
    digest = {t: namespace_digest(NAMESPACE.with_tenant(s)) for t, s in salt.items()}
    for tenant in salt:
        prefill(replica, f"r-{tenant}", PROMPT, salt[tenant])
    prefill(replica, "r-shared", PROMPT, None)
    assert namespaces(pool)[digest["acme"]] == CHUNKS and namespaces(pool)[digest["other"]] == CHUNKS

    result = kvshare("pool-admin", "--socket", pool, "flush", "--replica", url, "--tenant", "acme", "--yes")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "dropped": CHUNKS,
        "namespace": digest["acme"].hex(),
        "model": "tiny",
        "pool": pool,
    }
    left = namespaces(pool)
    assert digest["acme"] not in left  # the tenant's pages are gone
    assert left[digest["other"]] == CHUNKS and left[namespace_digest(NAMESPACE)] == CHUNKS  # the others' stay
    assert handler.served == 1
    assert replica.scheduler.num_leases == 0


def test_flush_by_tenant_with_an_api_key_salts_as_the_router(pool, vllm_like):  # noqa: F811
    """With API keys the router salts by the key's identity and the tenant header: the same namespace here."""
    replica, _, url = vllm_like
    salt = replica_salt("vllm", tenant_identity("key-of-a", "team"), None)
    prefill(replica, "r-keyed", PROMPT, salt)
    result = kvshare(
        "pool-admin", "--socket", pool, "flush", "--replica", url, "--tenant", "team", "--api-key", "key-of-a", "--yes"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["namespace"] == namespace_digest(NAMESPACE.with_tenant(salt)).hex()
    assert namespace_digest(NAMESPACE.with_tenant(salt)) not in namespaces(pool)


def test_a_vllm_server_without_the_connector_is_named(pool, vllm_like):  # noqa: F811
    _, handler, url = vllm_like
    handler.replica = None
    refused(
        kvshare("pool-admin", "--socket", pool, "flush", "--replica", url, "--tenant", "acme", "--yes"),
        "neither a kvshare replica nor a vLLM replica with kvshare's connector",
    )
