"""The router's own time in a request's TTFT: ``kvshare_router_send_delay_seconds``, from the request's arrival to
its sending to a replica (``kvshare bench routing`` reads it per replay: its "router send p99" column)."""

import asyncio
import json
import urllib.request

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvshare.router.config import RouterConfig
from kvshare.router.server import RouterServer
from tests.router.fake_replica import completion_request, replica_app
from tests.serve.live import LiveApp

REPLICA_S = 0.3  # how long the replica takes to answer


def test_the_send_delay_counts_each_request_once_and_not_the_replicas_time():
    """Fails when the delay is taken where the response ends (each sample >= the replica's 0.3 s) or is not taken."""

    async def completions(request):
        await asyncio.sleep(REPLICA_S)
        return web.json_response({"choices": [{"text": "a"}]})

    with LiveApp(replica_app(completions)) as replica_url:
        server = RouterServer(RouterConfig(replicas=(replica_url,)))
        with LiveApp(server.app()) as router_url:
            for _ in range(2):
                body = urllib.request.urlopen(completion_request(router_url, prompt="hi"), timeout=30).read()
                assert json.loads(body)["choices"][0]["text"] == "a"
            with urllib.request.urlopen(router_url + "/metrics", timeout=30) as resp:
                text = resp.read().decode()
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvshare_router_send_delay_seconds") and s.labels.get("le") in (None, "+Inf")
    }
    assert samples["kvshare_router_send_delay_seconds_count"] == 2
    assert 0 < samples["kvshare_router_send_delay_seconds_sum"] < REPLICA_S
