"""`kvshare bench routing --engine vllm`: a tiny trace through two vLLM CPU replicas with the connector, the pool
with its KV events, the round_robin router and a pool_aware one that reads the pool's and each replica's events.

Suite ``vllm`` (run with the vLLM environment's python). Structure and the events' flow are checked, never speed.
"""

from __future__ import annotations

import json

import pytest

from kvshare.cli import build_parser
from kvshare.commands.bench_routing import routing_plan
from tests.integrations.vllm.servers import vllm_python, vllm_suite_marks

PYTHON = vllm_python()
pytestmark = vllm_suite_marks()


@pytest.mark.timeout(300)
def test_a_tiny_trace_through_vllm_replicas_with_the_pool_and_their_own_events(tmp_path, monkeypatch):
    """Every request completes under both conditions; the pool_aware router trusted the pool's and every
    replica's own KV events while it placed; the replicas loaded pool bytes (vLLM's connector counter); a turn
    sent again with a salt of its own is compared with the measured one. Fails when the replicas publish no
    events of their own (the router's replica feeds never go live), or when the bench reads only the built-in
    replicas' pool counter (pool bytes 0)."""
    from kvshare.bench.routing import run_routing

    monkeypatch.delenv("KVSHARE_ACCOUNT_KEY", raising=False)
    argv = ["bench", "routing", "--model", "tiny", "--engine", "vllm", "--vllm-python", PYTHON, "--sessions", "6"]
    argv += ["--prompts", "2", "--turns", "2", "--system-tokens", "300-400", "--user-tokens", "100-140"]
    argv += ["--answer-tokens", "4-8", "--gpu-share", "1.5", "--rates", "2", "--runs", "1", "--verify", "1"]
    argv += ["--conditions", "round_robin/on,pool_aware/on", "--timeout", "120"]
    config, target = routing_plan(build_parser().parse_args(argv))
    summary, report = run_routing(config, target, str(tmp_path), "kvshare bench routing (test)")

    rows = {row["condition"]: row for row in map(json.loads, (tmp_path / "routing.jsonl").read_text().splitlines())}
    assert set(rows) == {"round_robin/on", "pool_aware/on"}
    for row in rows.values():
        assert row["num_requests"] == 12 and row["num_errors"] == 0, row
        assert row["outputs_compared"] == 1 and len(row["output_checks"]) == 1
        assert row["prefill_tokens"] > 0
    assert rows["round_robin/on"]["pool_bytes_loaded"] > 0  # turns and shared prompts cross replicas
    assert rows["round_robin/on"]["replica_events_live_share"] is None  # it reads no events
    aware = rows["pool_aware/on"]
    assert aware["fallbacks"] == 0 and aware["events_live_share"] > 0.9, aware  # placed on the events, each time
    assert aware["replica_events_live_share"] > 0.9, aware  # both replicas' own events, (nearly) all along
    assert len(aware["per_replica"]) == 2 and all(url.startswith("http://") for url in aware["per_replica"])
    assert "| pool_aware/on |" in open(report).read()
    run = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])
    assert run["target"]["engine"] == "vllm" and "vllm replicas" in run["sizes"]
