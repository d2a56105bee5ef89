"""What a live router adds to a chat request's time to first byte, per policy, with nothing else on the machine busy.

    PYTHONPATH=$PWD python benchmarks/router_hop_cost.py [--policies round_robin,cache_aware,pool_aware]
        [--sessions 8] [--turns 6] [--model qwen3-8b]

Two stand-in replicas (this script with ``--fake-replica PORT``: /health, and a chat completion streamed as one
SSE event at once) and, per policy, a ``kvshare route`` process in front of them (pool_aware subscribed where
nothing publishes, so it places round robin but reads, encodes and hashes every prompt: the events-dropped
control's work). Sessions of ``--turns`` chat turns over 2 shared system prompts of 5000 tokens (700-token user
turns, 20-token answers, the presets' BPE), sent one at a time, each request once through the router and once
straight to a replica, in alternating order. Printed per policy: p50 / p90 / p99 of (through the router - straight),
in ms, over every turn, and over the later turns alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\ndata: [DONE]\n\n'


def fake_replica(port: int) -> None:
    from aiohttp import web

    async def health(request):
        return web.json_response({"status": "ok"})

    async def chat(request):
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(CHUNK)
        await response.write_eof()
        return response

    app = web.Application(client_max_size=64 << 20)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_ready(session, url: str) -> None:
    for _ in range(600):
        try:
            async with session.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} did not come up")


def chats(model: str, num_sessions: int, num_turns: int) -> list[list[tuple[str, bytes]]]:
    """Per session, per turn: (session id, chat body)."""
    from kvshare.bench.workload import PromptFactory, WorkloadConfig
    from kvshare.engine.loader import load_tokenizer

    factory = PromptFactory(load_tokenizer(model), WorkloadConfig(nonce="hop"))
    systems = [factory.user_text(5000, f"system{k}") for k in range(2)]
    out = []
    for s in range(num_sessions):
        history, turns = [{"role": "system", "content": systems[s % 2]}], []
        for t in range(num_turns):
            user = {"role": "user", "content": factory.user_text(700, f"s{s}u{t}")}
            body = {"model": "m", "messages": [*history, user], "max_tokens": 1, "stream": True}
            turns.append((f"s{s}", json.dumps(body).encode()))
            history += [user, {"role": "assistant", "content": factory.user_text(20, f"s{s}a{t}")}]
        out.append(turns)
    return out


async def first_byte_s(session, url: str, session_id: str, body: bytes) -> float:
    headers = {"Content-Type": "application/json", "X-Session-ID": session_id}
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as resp:
        await resp.content.readany()
        elapsed = time.perf_counter() - t0
        await resp.read()
    return elapsed


async def measure(args, policy: str, replicas: list[str], sessions) -> list[tuple[int, float]]:
    import aiohttp

    port = free_port()
    argv = [sys.executable, "-m", "kvshare", "route", "--port", str(port), "--policy", policy]
    argv += [a for url in replicas for a in ("--replica", url)]
    if policy == "pool_aware":
        argv += ["--kv-events", "tcp://127.0.0.1:1", "--model", args.model]
    router = start(argv)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url)
            added = []
            for turns in sessions:
                for k, (session_id, body) in enumerate(turns):
                    pair = [url, replicas[k % 2]] if k % 2 else [replicas[k % 2], url]
                    times = {u: await first_byte_s(session, u, session_id, body) for u in pair}
                    added.append((k, times[url] - times[replicas[k % 2]]))
            return added
    finally:
        router.terminate()
        router.wait(10)


def row(policy: str, values: list[float]) -> str:
    from kvshare.stats import percentile

    ms = [v * 1e3 for v in values]
    return f"| {policy} | {len(ms)} | " + " | ".join(f"{percentile(ms, q):.2f}" for q in (50, 90, 99))


async def run(args) -> None:
    ports = [free_port() for _ in range(2)]
    fakes = [start([sys.executable, __file__, "--fake-replica", str(p)]) for p in ports]
    replicas = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            for url in replicas:
                await wait_ready(session, url)
        sessions = chats(args.model, args.sessions, args.turns)
        print("| policy | requests | added p50 ms | p90 ms | p99 ms | later turns: p50 ms | p90 ms | p99 ms |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for policy in args.policies.split(","):
            added = await measure(args, policy, replicas, sessions)
            later = row("", [a for k, a in added if k]).split(" | ", 2)[2]
            print(row(policy, [a for _, a in added]) + " | " + later + " |")
    finally:
        for fake in fakes:
            fake.terminate()
            fake.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fake-replica", type=int, help=argparse.SUPPRESS)
    p.add_argument("--policies", default="round_robin,cache_aware,pool_aware")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--model", default="qwen3-8b", help="the router's tokenizer: a preset or model directory")
    args = p.parse_args()
    if args.fake_replica:
        fake_replica(args.fake_replica)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
