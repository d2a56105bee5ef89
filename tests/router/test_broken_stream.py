"""A replica that dies mid-response: the router's client must see that the answer is incomplete."""

import asyncio
import http.client
import json
import urllib.parse

from aiohttp import web

from kvshare.router.config import RouterConfig
from kvshare.router.server import RouterServer
from tests.serve.live import LiveApp, call


def dying_replica() -> web.Application:
    """/health answers 200; a completion streams two events (or half a JSON body), then the connection drops."""

    async def health(request):
        return web.json_response({"status": "ok"})

    async def completions(request):
        body = await request.json()
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for text in ("Once", " upon"):
                await response.write(b'data: {"choices": [{"index": 0, "text": "%s"}]}\n\n' % text.encode())
        else:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"choices": [{"index": 0, "text": "Once upon')
        await asyncio.sleep(0.05)
        request.transport.abort()  # as a killed process leaves it
        return response

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return app


def raw_post(url: str, body: dict) -> tuple[int, bytes, str]:
    """(status, the bytes received, how the body ended): "eof" or the error that cut it off."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    received = b""
    try:
        while chunk := resp.read1(65536):
            received += chunk
        ended = "eof"
    except (http.client.IncompleteRead, ConnectionError) as exc:
        ended = type(exc).__name__
    conn.close()
    return resp.status, received, ended


def test_a_stream_cut_off_by_its_replica_ends_with_an_error_event_and_no_done():
    """Fails when the router ends the client's stream cleanly (write_eof) after the replica's connection broke."""
    with LiveApp(dying_replica()) as replica_url:
        router = RouterServer(RouterConfig(replicas=(replica_url,), health_interval_s=60))
        with LiveApp(router.app()) as router_url:
            status, received, ended = raw_post(router_url, {"prompt": "x", "stream": True})
            events = [line[len(b"data: ") :] for line in received.split(b"\n\n") if line.startswith(b"data: ")]
            assert status == 200 and ended == "eof" and b"[DONE]" not in received
            assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["Once", " upon"]
            error = json.loads(events[-1])["error"]
            assert error["type"] == "server_error" and error["code"] == "replica_failed"
            assert replica_url in error["message"]
            samples = router.metrics.broken_responses.collect()[0].samples
            counted = [(s.labels["replica"], s.value) for s in samples if s.name.endswith("_total")]
            assert counted == [(replica_url, 1.0)]
            status, health = call(router_url, "/health")
            assert status == 503 and health["replicas"][0]["healthy"] is False
            assert "broke off" in health["replicas"][0]["error"]

            # a body that is not a stream is cut off, not ended as if whole
            status, received, ended = raw_post(router_url, {"prompt": "x"})
            assert ended != "eof" and received.startswith(b'{"choices"')
