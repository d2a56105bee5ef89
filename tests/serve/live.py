"""In-process servers for tests: an aiohttp app on a free loopback port, run by its own event loop thread.

Faster than `kvshare up` (no child processes, one engine built per module) and still real HTTP, so the
tests call it with urllib or the openai SDK as a user would.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

from aiohttp import web


class LiveApp:
    """``with LiveApp(app) as url:`` serves ``app`` at ``url`` until the block ends."""

    def __init__(self, app: web.Application) -> None:
        self._runner = web.AppRunner(app, access_log=None)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="live-app", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def _start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()


def call(
    url: str, path: str, body=None, method: str | None = None, raw: bytes | None = None, headers: dict | None = None
) -> tuple[int, object]:
    """(status, parsed JSON body or b"" when empty) of one request; HTTP errors are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, payload = err.code, err.read()
    return status, json.loads(payload) if payload else b""


def metric(url: str, name: str) -> float | None:
    """One Prometheus sample of ``url``/metrics, with whatever labels it has (model_name); None when absent."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    for line in text.splitlines():
        if line.split(" ")[0].split("{")[0] == name:
            return float(line.split()[-1])
    return None


def tiny_engine(model: str = "tiny", **config):
    """The built-in engine on CPU without a pool (about 5-10 s to build on a busy 2-core machine)."""
    from kvshare.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=model, local_cache_bytes=0, **config))


def replica(engine, **config) -> LiveApp:
    """A replica (ReplicaServer) around ``engine``, served in-process."""
    from kvshare.serve.config import ServeConfig
    from kvshare.serve.server import ReplicaServer

    return LiveApp(ReplicaServer(engine, ServeConfig(replica_name="replica0", **config)).app())
