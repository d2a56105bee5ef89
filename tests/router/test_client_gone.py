"""A client that hangs up frees its replica through the router as it does sent straight to one.

A non-streamed response shows nothing before its end: its headers come with its body. A router that watches
its client only once the replica's headers arrive lets an abandoned completion run to its end, the replica
(one request at a time) makes every later request wait behind it, and the router then writes the headers to a
closed connection (a traceback in its log). These run a live router in front of a real built-in replica.
"""

import asyncio
import http.client
import json
import logging
import threading
import time
import urllib.parse
import urllib.request

import pytest

from kvshare.router.config import RouterConfig
from kvshare.router.server import RouterServer
from tests.serve.live import LiveApp, call, metric, replica, tiny_engine

# far more decode than the test waits for: an abandoned request that runs on is seen running long after its
# client left (the tiny preset decodes ~200-400 tokens/s on 2 busy cores)
LONG_TOKENS = 8000
FREED_WITHIN_S = 10.0  # the replica is expected free within a second; the bound allows for a loaded machine


@pytest.fixture(scope="module")
def replica_url():
    with replica(tiny_engine()) as url:
        yield url


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as resp:
        return json.loads(resp.read())


def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until ``predicate()`` held; fails with ``what`` after ``timeout_s``."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, what
        time.sleep(0.05)
    return time.monotonic() - t0


def cancelled(url: str) -> float:
    return metric(url, "kvshare_request_cancelled_total") or 0.0


@pytest.mark.parametrize("is_stream", [False, True], ids=["unstreamed", "streamed"])
def test_a_client_that_hangs_up_through_the_router_frees_the_replica_at_once(replica_url, is_stream, caplog):
    """Fails when the router watches its client only once the replica's headers arrive: the unstreamed request
    then runs on (no cancel counted on the replica), and the router later logs a traceback."""
    server = RouterServer(RouterConfig(replicas=(replica_url,)))
    before = cancelled(replica_url)
    with caplog.at_level(logging.INFO), LiveApp(server.app()) as router_url:
        parts = urllib.parse.urlsplit(router_url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        body = {"prompt": "abc", "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": is_stream}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        wait_until(lambda: health(replica_url)["running"] == 1, 60, "the replica never started the request")
        if is_stream:
            assert conn.getresponse().read1(64)  # the stream has begun
        time.sleep(0.3)  # decoding
        conn.sock.shutdown(2)
        conn.close()
        hung_up = time.monotonic()
        wait_until(lambda: cancelled(replica_url) > before, FREED_WITHIN_S, "the replica did not see its client go")
        wait_until(lambda: health(replica_url)["running"] == 0, FREED_WITHIN_S, "the replica still decodes")
        freed_s = time.monotonic() - hung_up
        status, out = call(router_url, "/v1/completions", {"prompt": "next", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        wait_until(lambda: server.replicas[0].num_in_flight == 0, FREED_WITHIN_S, "the router still relays it")
    assert freed_s < FREED_WITHIN_S
    tracebacks = [r for r in caplog.records if r.exc_info or "Error handling request" in r.getMessage()]
    assert tracebacks == []


def test_a_client_gone_before_the_replica_answers_leaves_no_traceback_in_the_router(caplog):
    """A replica that answers 2 s after its client left: the router closes its request at once (the replica sees
    its connection close) and writes nothing to the closed client. Fails when the router waits for the answer
    and then writes its headers to the closed connection ("Cannot write to closing transport")."""
    from aiohttp import web

    from kvshare.serve.connection import is_gone
    from tests.router.fake_replica import replica_app

    arrived, seen_gone = threading.Event(), []

    async def completions(request):
        arrived.set()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not is_gone(request):
            await asyncio.sleep(0.01)
        seen_gone.append(is_gone(request))
        return web.json_response({"choices": [{"text": "a"}]})

    with caplog.at_level(logging.INFO), LiveApp(replica_app(completions)) as fake_url:
        server = RouterServer(RouterConfig(replicas=(fake_url,)))
        with LiveApp(server.app()) as router_url:
            parts = urllib.parse.urlsplit(router_url)
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "abc"}), {"Content-Type": "application/json"})
            assert arrived.wait(30)
            conn.sock.shutdown(2)
            conn.close()
            wait_until(lambda: seen_gone, 30, "the replica never answered")
            wait_until(lambda: server.replicas[0].num_in_flight == 0, 30, "the router still relays it")
    assert seen_gone == [True]
    tracebacks = [r for r in caplog.records if r.exc_info or "Error handling request" in r.getMessage()]
    assert tracebacks == []
