"""kvshare load: the tool's parts (pure), a negative control against a server that answers wrongly when the
pool is on, and a short run of the CLI against a `kvshare up` cluster: no error, no mismatch, no 429."""

import asyncio
import json
import random
import socket
import subprocess
import sys
import threading

import pytest
from aiohttp import web

from kvshare.reliability.exchange import Outcome
from kvshare.reliability.load import LoadConfig, LoadRun, require_loopback
from kvshare.reliability.summary import LoadTally, first_difference
from kvshare.reliability.workload import Conversation, documents, reference_body
from tests.reliability.conftest import load_figures, pool_is_clean, report, start


def test_workload_is_seeded_and_grows_until_the_context_bound():
    assert documents(3, 4, 100, 200) == documents(3, 4, 100, 200) != documents(4, 4, 100, 200)
    conv = Conversation("chat", "doc", random.Random(1))
    body = conv.body("m", 8)
    assert body["messages"][0] == {"role": "system", "content": "doc"} and body["stream"] and body["return_token_ids"]
    conv.advance("reply")
    assert [m["role"] for m in conv.body("m", 8)["messages"]] == ["system", "user", "assistant", "user"]
    ref = reference_body(body)
    assert ref["kvshare"] == {"use_pool": False, "use_local_cache": False} and not ref["stream"]
    assert ref["messages"] == body["messages"] and ref["temperature"] == 0.0
    comp = Conversation("completion", "doc", random.Random(1))
    comp.advance("xyz")
    assert comp.body("m", 8)["prompt"].startswith("doc\n\nQ: ") and "xyz\nQ: " in comp.body("m", 8)["prompt"]


def test_comparison_and_tally():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1 and first_difference([1, 2], [1, 2, 3]) == 2
    tally = LoadTally(started_at=0.0)
    good = Outcome(status=200, token_ids=[1, 2, 3], provenance={"pool_tokens": 256, "local_tokens": 0})
    tally.add(good)
    tally.add(Outcome(status=429, error="HTTP 429: full"))
    tally.add(Outcome(status=0, error="ServerDisconnectedError: gone"))
    tally.add_check(good, Outcome(status=200, token_ids=[1, 2, 3], provenance={}), "same")
    tally.add_check(
        good,
        Outcome(status=200, token_ids=[1, 9, 3], provenance={}, top_logprobs=[{}, {"9": -0.1, "2": -0.2}]),
        "differs",
    )
    s = tally.summary(1.0, {}, 0)
    assert (s["ok"], s["errors"], s["rate_limited"], s["checked"], s["mismatches"]) == (1, 1, 1, 2, 1)
    assert s["details"][-1]["step"] == 1 and s["details"][-1]["reference_top2_gap"] == pytest.approx(0.1)


def test_loopback_only_and_config_checks():
    for url in ("http://127.0.0.1:8080", "http://localhost:1", "http://[::1]:8080", "http://127.3.4.5:9"):
        require_loopback(url)
    for url in ("http://10.1.2.3:8080", "http://192.168.0.1", "http://8.8.8.8:80", "ftp://127.0.0.1", "127.0.0.1:80"):
        with pytest.raises(ValueError):
            LoadConfig(url=url)
    with pytest.raises(ValueError):
        LoadConfig(url="http://127.0.0.1:1", max_context_tokens=500)  # no room for a turn after a long document
    with pytest.raises(ValueError):
        LoadConfig(url="http://127.0.0.1:1", num_tenants=2)  # tenants need a header


class WrongWhenPooled:
    """A fake replica whose pool-on answers differ from its pool-off ones in every 3rd request."""

    def __init__(self) -> None:
        self.num_requests = 0

    async def models(self, request):
        return web.json_response({"data": [{"id": "fake"}]})

    async def completions(self, request):
        body = await request.json()
        self.num_requests += 1
        is_off = body.get("kvshare", {}).get("use_pool") is False
        ids = [7] * body["max_tokens"]
        if not is_off and self.num_requests % 3 == 0:
            ids[-1] = 8
        prov = {"replica": "fake", "local_tokens": 0, "pool_tokens": 0 if is_off else 256, "computed_tokens": 1}
        if not body.get("stream"):
            return web.json_response(
                {
                    "choices": [{"text": "x", "token_ids": ids, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 10},
                    "kvshare": prov,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in (
            {"choices": [{"text": "x"}]},
            {"choices": [{"text": "", "finish_reason": "length", "token_ids": ids}], "kvshare": prov},
            {"choices": [], "usage": {"prompt_tokens": 10}},
        ):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def test_negative_control_a_server_that_answers_wrongly_with_the_pool_is_caught():
    fake = WrongWhenPooled()
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/v1/completions", fake.completions)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    async def serve():
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    thread.start()
    ready.wait(10)
    try:
        summary = asyncio.run(
            LoadRun(
                LoadConfig(
                    url=f"http://127.0.0.1:{port}",
                    num_sessions=2,
                    duration_s=1.0,
                    chat_share=0.0,
                    check_share=1.0,
                    request_timeout_s=10,
                )
            ).run()
        )
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert summary["errors"] == 0 and summary["checked"] > 3
    assert summary["mismatches"] > 0 and any(d.get("mismatch") for d in summary["details"])


@pytest.mark.reliability
def test_load_cli_against_a_cluster_no_errors_no_mismatches():
    cluster = start("alternate")
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvshare",
                "load",
                "--url",
                cluster.router_url,
                "--sessions",
                "8",
                "--duration",
                "20",
                "--check-share",
                "0.3",
                "--max-tokens",
                "6",
                "--pool",
                cluster.pool_socket,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        summary = json.loads(out.stdout)
        report("load", **load_figures(summary), pool=summary["pool"])
        assert summary["errors"] == 0 and summary["mismatches"] == 0 and summary["rate_limited"] == 0
        assert summary["unfinished"] == 0 and summary["references_not_cold"] == 0
        assert summary["ok"] >= 20 and summary["checked"] >= 3
        assert summary["tokens_by_source"]["pool_tokens"] > 0  # sessions alternate replicas: the pool was used
        assert set(summary["replicas"]) == {"replica0", "replica1"}
        assert summary["pool"]["integrity"] == "ok" and summary["pool"]["leases"] == 0
        assert summary["latency_s"]["p99"] >= summary["latency_s"]["p50"] > 0
        pool_is_clean(cluster.pool_socket)
    finally:
        cluster.stop()
