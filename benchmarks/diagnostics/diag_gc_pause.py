"""Diagnostic (CPU): garbage-collector pauses inside a serving replica, with and without the startup heap frozen.

An in-process replica of the tiny model (as `kvshare serve` builds it) answers N streamed completions
over HTTP; gc.callbacks time every collection. Prints, per setting, the tracked objects at the start,
and the count, total and longest pause of the collections of each generation during the requests.

    python3 benchmarks/diagnostics/diag_gc_pause.py [N]
"""
import asyncio
import gc
import json
import sys
import threading
import time

import aiohttp
from aiohttp import web

from kvshare.engine.engine import Engine, EngineConfig
from kvshare.heap import freeze_startup_heap
from kvshare.serve.server import ReplicaServer, ServeConfig

N = int(sys.argv[1]) if len(sys.argv) > 1 else 300
pauses: list[tuple[int, float]] = []
_started: dict[str, float] = {}


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _started["t"] = time.perf_counter()
    else:
        pauses.append((info["generation"], time.perf_counter() - _started.pop("t", time.perf_counter())))


async def serve_and_send(server: ReplicaServer) -> None:
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = "http://127.0.0.1:%d/v1/completions" % runner.addresses[0][1]
    async with aiohttp.ClientSession() as session:
        for i in range(N):
            body = {"model": "tiny", "prompt": [(i * 7 + k) % 250 for k in range(1000)], "max_tokens": 4,
                    "stream": True, "kvshare": {"timeline": True}}
            async with session.post(url, json=body) as resp:
                async for _ in resp.content:
                    pass
    await runner.cleanup()


for setting in ("unfrozen", "frozen"):
    gc.unfreeze()
    server = ReplicaServer(Engine(EngineConfig(model="tiny")), ServeConfig(replica_name="r", warmup=False))
    if setting == "frozen":
        freeze_startup_heap()
    tracked = len(gc.get_objects())
    pauses.clear()
    gc.callbacks.append(on_gc)
    started = time.perf_counter()
    asyncio.run(serve_and_send(server))
    gc.callbacks.remove(on_gc)
    by_gen = {g: [d for gen, d in pauses if gen == g] for g in (0, 1, 2)}
    print(json.dumps({"setting": setting, "requests": N, "tracked_objects": tracked,
                      "frozen": gc.get_freeze_count(), "seconds": round(time.perf_counter() - started, 1),
                      **{f"gen{g}": {"count": len(d), "total_ms": round(1e3 * sum(d), 2),
                                     "max_ms": round(1e3 * max(d, default=0.0), 2)} for g, d in by_gen.items()}}),
          flush=True)
    server.engine.close()
