"""`kvshare bench routing --engine vllm`: a tiny trace through two vLLM CPU replicas with the connector, the pool
with its KV events, the round_robin router and a pool_aware one that reads the pool's and each replica's events.

Suite ``vllm`` (run with the vLLM environment's python). Structure and the events' flow are checked, never speed.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from kvshare.cli import build_parser
from kvshare.commands.bench_routing import routing_plan
from kvshare.integrations.vllm.launch import VllmServerConfig
from kvshare.router.config import RouterConfig
from kvshare.router.pool_aware import PoolAwareConfig
from kvshare.router.server import RouterServer
from tests.integrations.vllm.servers import free_port, start_servers, stop_servers, vllm_python, vllm_suite_marks
from tests.integrations.vllm.tiny_model import make_model_dir
from tests.serve.live import LiveApp

PYTHON = vllm_python()
pytestmark = vllm_suite_marks()


@pytest.mark.timeout(300)
def test_a_tiny_trace_through_vllm_replicas_with_the_pool_and_their_own_events(tmp_path, monkeypatch):
    """Every request completes under both conditions (round_robin's router sending the replicas prefetch hints, on
    which they copy pages ahead); the pool_aware router trusted the pool's and every
    replica's own KV events while it placed, and measured every replica from its responses; the replicas loaded
    pool bytes (vLLM's connector counter); a turn sent again with a salt of its own is compared with the
    measured one. Fails when the replicas publish no events of their own (the router's replica feeds never go
    live), when the bench reads only the built-in replicas' pool counter (pool bytes 0), or when the router
    reads no token counts from vLLM's streams (no prefill samples: they carry no ``kvshare`` object)."""
    from kvshare.bench.routing import run_routing

    monkeypatch.delenv("KVSHARE_ACCOUNT_KEY", raising=False)
    argv = ["bench", "routing", "--model", "tiny", "--engine", "vllm", "--vllm-python", PYTHON, "--sessions", "6"]
    argv += ["--prompts", "2", "--turns", "2", "--system-tokens", "300-400", "--user-tokens", "100-140"]
    argv += ["--answer-tokens", "4-8", "--gpu-share", "1.5", "--rates", "2", "--runs", "1", "--verify", "1"]
    argv += ["--conditions", "round_robin/hints,pool_aware/on", "--timeout", "120"]
    config, target = routing_plan(build_parser().parse_args(argv))
    summary, report = run_routing(config, target, str(tmp_path), "kvshare bench routing (test)")

    rows = {row["condition"]: row for row in map(json.loads, (tmp_path / "routing.jsonl").read_text().splitlines())}
    assert set(rows) == {"round_robin/hints", "pool_aware/on"}
    for row in rows.values():
        assert row["num_requests"] == 12 and row["num_errors"] == 0, row
        assert row["outputs_compared"] == 1 and len(row["output_checks"]) == 1
        assert row["prefill_tokens"] > 0
        assert 0 < row["router_send_p99_s"] < 1  # the router's own time, from its histogram (no replica timeline)
    hinted = rows["round_robin/hints"]
    assert hinted["pool_bytes_loaded"] > 0  # turns and shared prompts cross replicas
    assert hinted["replica_events_live_share"] is None  # it reads no events
    # its router announced each request to its replica, which copied pages ahead on those hints (whether a load
    # took them first is a race on CPU, where vLLM schedules a request within milliseconds: prefetch_hits)
    assert hinted["hints"] == 12 and hinted["prefetched_pages"] > 0, hinted
    aware = rows["pool_aware/on"]
    assert aware["hints"] == 0  # a router without --hint-address sends none
    assert aware["fallbacks"] == 0 and aware["events_live_share"] > 0.9, aware  # placed on the events, each time
    assert aware["replica_events_live_share"] > 0.9, aware  # both replicas' own events, (nearly) all along
    # every replica measured from its streams' usage (vLLM's cached tokens, split by the router's record)
    assert all(terms["prefill_samples"] > 0 for terms in aware["pool_aware_terms"].values()), aware
    assert len(aware["per_replica"]) == 2 and all(url.startswith("http://") for url in aware["per_replica"])
    assert "| pool_aware/on |" in open(report).read()
    run = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])
    assert run["target"]["engine"] == "vllm" and "vllm replicas" in run["sizes"]


@pytest.mark.timeout(400)
def test_a_pool_aware_router_relays_a_vllm_stream_as_vllm_sent_it_and_measures_the_replica(tmp_path):
    """A client that does not ask for usage gets through a pool_aware router the bytes vLLM sends it directly
    (the same X-Request-Id; ``created`` aside, the second each was made), though the router asked the replica
    for the usage chunk; the router's calibration has the response as a prefill sample (all its prompt computed:
    the replica was fresh). Fails when the usage chunk reaches the client, when the terminal chunk lacks the
    system_fingerprint vLLM puts there for a client that did not ask, or when the router does not ask for the
    usage (no sample)."""
    model = make_model_dir(str(tmp_path / "model"))
    config = VllmServerConfig(model=model, port=free_port(), python=PYTHON, served_model_name="tiny", dtype="float32")
    servers = start_servers({"a": config}, str(tmp_path))
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "stream": True}

    def stream(url: str) -> bytes:
        headers = {"Content-Type": "application/json", "X-Request-Id": "same"}
        request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(request, timeout=120) as response:
            return re.sub(rb'"created":\d+', b'"created":0', response.read())

    try:
        router = RouterServer(
            RouterConfig(
                replicas=(servers["a"].url,),
                policy="pool_aware",
                engine="vllm",
                pool_aware=PoolAwareConfig(endpoint="tcp://127.0.0.1:1", model=model),  # no events: round robin
            )
        )
        with LiveApp(router.app()) as router_url:
            routed = stream(router_url)  # first: the replica holds nothing of the prompt yet
            fit = router.pool_aware.calibration.replicas[0]
            for _ in range(100):  # the relay records the end after its last write
                if fit.samples:
                    break
                time.sleep(0.02)
        direct = stream(servers["a"].url)
    finally:
        stop_servers(servers)
    assert routed == direct
    assert b'"usage"' not in routed and b'"system_fingerprint"' in routed and routed.endswith(b"data: [DONE]\n\n")
    [(computed, pool, prefill_s)] = fit.samples
    assert (computed, pool) == (len(prompt), 0) and prefill_s > 0  # the tiny preset: one token a byte
