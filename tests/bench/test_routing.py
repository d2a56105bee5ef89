"""bench routing: the trace, the figures, and a short CPU replay of the two controls through real routers.

What is checked is structure and the controls' behaviour, never speed: events dropped -> every request
counted as a fallback and placed round robin, outputs equal to a recompute; no shared prefix -> nothing
reused from any cache, no byte loaded from the pool.
"""

from __future__ import annotations

import json

import pytest

from kvshare.bench.records import Record
from kvshare.bench.routing_summary import highest_complete_rate, replay_row, router_added_s, summarize
from kvshare.bench.routing_trace import RoutingConfig, make_trace, parse_condition, scaled


def test_the_trace_is_a_function_of_the_seed_with_prompts_spread_evenly():
    config = RoutingConfig(num_sessions=10, num_prompts=4, num_turns=3, system_tokens=(400, 600), seed=7)
    trace = make_trace(config)
    assert trace == make_trace(config)
    assert trace != make_trace(RoutingConfig(num_sessions=10, num_prompts=4, num_turns=3, system_tokens=(400, 600)))
    counts = [sum(s.prompt == p for s in trace.sessions) for p in range(4)]
    assert sorted(counts) == [2, 2, 3, 3]
    starts = [s.start_s for s in trace.sessions]
    assert starts[0] == 0.0 and starts == sorted(starts) and len(set(starts)) == 10
    assert all(400 <= n <= 600 for n in trace.system_tokens)
    assert trace.num_requests == 30
    assert trace.working_set_tokens() == sum(trace.system_tokens) + sum(
        sum(s.user_tokens) + sum(s.answer_tokens) for s in trace.sessions
    )


def test_conditions_and_sizes_are_checked():
    assert parse_condition("pool_aware_gpu/on").router == "pool_aware_gpu"
    assert parse_condition("round_robin/off").use_pool is False
    assert parse_condition("no_shared_prefix").is_shared is False
    assert parse_condition("events_dropped").router == "pool_aware_dropped"
    for bad in ("pool_aware", "fastest/on", "sticky/maybe"):
        with pytest.raises(ValueError, match="unknown condition"):
            parse_condition(bad)
    with pytest.raises(ValueError, match="range"):
        RoutingConfig(user_tokens=(300, 200))
    with pytest.raises(ValueError, match="gpu-share"):
        RoutingConfig(gpu_share=0.5)
    assert scaled((4000, 6000), 0.1) == (400, 600) and scaled((1, 3), 0.01) == (1, 1)


def record(turn, ttft, replica, computed, pool=0, role="measure", written=None, started=0.0, e2e=1.0, check=None):
    return Record(
        "r",
        "routing",
        "u",
        "c",
        role,
        100,
        "url",
        completion_tokens=10,
        replica=replica,
        turn=turn,
        ttft_s=ttft,
        e2e_s=e2e,
        computed_tokens=computed,
        pool_tokens=pool,
        local_tokens=0,
        started_at=started,
        output_check=check,
        timeline=None if written is None else {"first_token_written": written},
    )


def test_a_replay_row_splits_first_and_later_turns_and_the_summary_pools_runs():
    records = [
        record(0, 0.5, "replica0", 300, written=0.4, check="equal"),
        record(1, 0.2, "replica1", 50, 250),
        record(1, None, None, 0),
        record(1, 0.1, "replica0", 0, role="verify"),
    ]
    row = replay_row("k", 2.0, "pool_aware/on", 0, records, 3.0, 4096.0, 0.0, [0.01])
    assert row["ttft_first_s"] == [0.5] and row["ttft_later_s"] == [0.2]
    assert row["num_requests"] == 3 and row["num_errors"] == 1
    assert row["prefill_tokens"] == 350 and row["pool_tokens"] == 250
    assert row["router_added_s"] == [pytest.approx(0.1)] and router_added_s(records[1]) is None
    assert row["per_replica"] == {"replica0": 1, "replica1": 1}
    assert (row["outputs_compared"], row["outputs_equal"]) == (1, 1)
    assert row["output_tokens_per_s"] == pytest.approx(20 / 1.0)
    other = dict(row, run=1, num_errors=0, ttft_first_s=[0.7], prefill_tokens=450)
    (summary,) = summarize([row, other])
    assert summary["num_runs"] == 2 and summary["ttft_first_p50"]["n"] == 2
    assert summary["prefill_tokens"]["value"] == 400 and 350 <= summary["prefill_tokens"]["low"] <= 400
    assert highest_complete_rate([summary]) is None  # one request failed at the only rate
    assert highest_complete_rate(summarize([other])) == 2.0


@pytest.mark.timeout(420)
def test_the_controls_through_real_routers_on_cpu(tmp_path, monkeypatch):
    """One cluster (pool with KV events, 2 tiny replicas), the two controls, one run.

    Fails when the no-shared-prefix control shares its system prompt (the replay reuses chunks from the local
    caches and the pool), and when the events-dropped router is given the pool's events (no fallback counted).
    """
    from kvshare.bench.routing import kv_bytes_per_token, run_routing
    from kvshare.bench.routing_cluster import RoutingTarget

    pytest.importorskip("zmq")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two replicas on a shared machine: no thread oversubscription
    config = RoutingConfig(
        num_sessions=4,
        num_prompts=2,
        num_turns=2,
        system_tokens=(300, 400),
        user_tokens=(20, 40),
        answer_tokens=(2, 4),
        rates=(4.0,),
        conditions=("no_shared_prefix", "events_dropped"),
        num_runs=1,
        num_verify=1,
    )
    per_token = kv_bytes_per_token("tiny")
    working_set = make_trace(config).working_set_tokens() * per_token
    target = RoutingTarget(
        model="tiny",
        local_cache_bytes=working_set // 2,
        pool_bytes=64 << 20,
        kv_bytes_per_token=per_token,
        replica_args=("--no-warmup",),
    )
    summary, report = run_routing(config, target, str(tmp_path), "kvshare bench routing (test)")

    rows = {row["condition"]: row for row in map(json.loads, (tmp_path / "routing.jsonl").read_text().splitlines())}
    assert set(rows) == {"no_shared_prefix", "events_dropped"}
    for row in rows.values():
        assert row["num_requests"] == 8 and row["num_errors"] == 0
        assert row["outputs_compared"] == 1 and row["outputs_equal"] == 1  # no wrong KV under either
        assert len(row["ttft_first_s"]) == 4 and len(row["ttft_later_s"]) == 4
        assert 0 < row["router_send_p99_s"] < 1  # the router's own time before sending, by its histogram
    dropped, unshared = rows["events_dropped"], rows["no_shared_prefix"]
    assert dropped["fallbacks"] == 8  # every request placed while the events were not live, and counted
    counts = sorted(dropped["per_replica"].values())
    assert len(counts) == 2 and counts[1] - counts[0] <= 1  # round robin: the replicas in turn
    assert dropped["event_lag_s"] == [] and dropped["events_live_share"] == 0  # no batch ever arrived
    assert unshared["pool_bytes_loaded"] == 0 and unshared["pool_tokens"] == 0 and unshared["local_tokens"] == 0
    assert unshared["fallbacks"] == 0  # its router's events were live: the control is pool_aware, not a fallback
    assert unshared["events_live_share"] > 0
    # what the pool did during each replay: the no-shared-prefix prompts are all new, so it committed pages and
    # published their events; nothing was evicted from 64 MiB
    pool = unshared["pool_counters"]
    assert pool["committed_pages"] > 0 and pool["kv_events_events"] >= pool["committed_pages"]
    assert pool["kv_events_batches"] > 0 and pool["evictions"] == 0
    terms = unshared["pool_aware_terms"]  # the router's measured cost terms, per replica, end of the replay
    assert len(terms) == 2 and all(t["prefill_seconds_per_token"] > 0 and "rate_samples" in t for t in terms.values())

    assert {s["condition"] for s in summary} == {"no_shared_prefix", "events_dropped"}
    run = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])
    assert run["command"] == "kvshare bench routing (test)" and "cores usable" in run["hardware"]
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 18 and {r["role"] for r in records} == {"measure", "verify"}
    assert "| events_dropped |" in open(report).read() and "router send p99 ms" in open(report).read()
