"""The router answers like a replica: the same status and OpenAI error body for what either refuses, the
vLLM endpoints forwarded (/tokenize, /detokenize) or answered (/version, /ping)."""

import socket
import time

import pytest

import kvshare
from kvshare.router.config import RouterConfig
from kvshare.router.server import RouterServer
from tests.serve.live import LiveApp, call, replica, tiny_engine

ERROR_FIELDS = {"message", "type", "param", "code"}
MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def urls():
    """(router URL, replica URL): one in-process replica of the tiny model behind an in-process router."""
    with replica(tiny_engine(), max_body_bytes=MAX_BODY) as replica_url:
        router = RouterServer(RouterConfig(replicas=(replica_url,), max_body_bytes=MAX_BODY, health_interval_s=0.2))
        with LiveApp(router.app()) as router_url:
            yield router_url, replica_url


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    "method, path, raw",
    [
        ("GET", "/nope", None),  # answered by the router itself
        ("POST", "/nope", b"{}"),
        ("GET", "/v1/completions", None),  # 405
        ("DELETE", "/v1/models", None),
        ("POST", "/v1/nope", b"{}"),  # forwarded
        ("POST", "/v1/completions", b"{not json"),
        ("POST", "/v1/completions", b'{"model": "nope", "prompt": "x"}'),
        ("POST", "/tokenize", b"{not json"),
        ("POST", "/v1/completions", b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}'),  # 413
    ],
    ids=lambda v: v[:40].decode() if isinstance(v, bytes) else str(v),
)
def test_router_and_replica_answer_errors_alike(urls, method, path, raw):
    router_url, replica_url = urls
    got_router = call(router_url, path, method=method, raw=raw)
    got_replica = call(replica_url, path, method=method, raw=raw)
    assert got_router == got_replica
    status, body = got_router
    assert status >= 400 and set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body


def test_vllm_endpoints_through_the_router(urls):
    router_url, replica_url = urls
    for path, body in [
        ("/tokenize", {"prompt": "hello there"}),
        ("/detokenize", {"tokens": [104, 105]}),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        assert call(router_url, path, body) == call(replica_url, path, body)
        assert call(router_url, path, body)[0] == 200
    assert call(router_url, "/version") == (200, {"version": kvshare.__version__})
    assert call(router_url, "/ping") == (200, b"") and call(router_url, "/ping", method="POST") == (200, b"")


def test_router_errors_of_its_own_have_the_replicas_shape(urls):
    router_url, _ = urls
    status, body = call(router_url, "/admin/drain", raw=b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and set(body["error"]) == ERROR_FIELDS
    status, body = call(router_url, "/admin/drain", {"replica": "http://elsewhere:1"})
    assert status == 404 and body["error"]["code"] == "not_found" and body["error"]["param"] == "replica"


def test_no_healthy_replica_is_a_503_openai_error():
    router = RouterServer(RouterConfig(replicas=(closed_port_url(),), health_interval_s=0.1, connect_timeout_s=2))
    with LiveApp(router.app()) as url:
        status, body = call(url, "/v1/completions", {"prompt": "x"})
        assert status == 503 and set(body["error"]) == ERROR_FIELDS
        assert body["error"]["type"] == "server_error" and body["error"]["code"] == "no_replica_available"
        deadline = time.monotonic() + 10
        while call(url, "/ping")[0] != 503:
            assert time.monotonic() < deadline, "/ping kept answering 200 with no replica up"
            time.sleep(0.1)
        assert call(url, "/ping")[1]["error"]["code"] == "no_replica_available"
