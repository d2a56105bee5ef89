"""A replica stand-in for router tests: /health answers 200, /v1/completions is the test's handler."""

from __future__ import annotations

import contextlib
import json
import urllib.request

from aiohttp import web

from kvshare.router.config import RouterConfig
from kvshare.router.cost_model import CostModel
from kvshare.router.pool_aware import PoolAwareConfig
from kvshare.router.server import RouterServer
from tests.serve.live import LiveApp


def replica_app(completions) -> web.Application:
    async def health(request):
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


@contextlib.contextmanager
def pool_aware_router(completions, cost: CostModel, engine: str = "builtin"):
    """A live router with the pool_aware policy (no event feed reachable) in front of one fake replica:
    yields (server, router_url)."""
    with LiveApp(replica_app(completions)) as replica_url:
        config = RouterConfig(
            replicas=(replica_url,),
            engine=engine,
            policy="pool_aware",
            pool_aware=PoolAwareConfig(endpoint="tcp://127.0.0.1:1", model="tiny", cost=cost),
        )
        server = RouterServer(config)
        with LiveApp(server.app()) as router_url:
            yield server, router_url


def completion_request(router_url: str, **body) -> urllib.request.Request:
    return urllib.request.Request(
        router_url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
