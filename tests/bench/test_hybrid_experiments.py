"""The study's experiments with the Qwen3.5 hybrid (qwen3.5-tiny) through a real cluster on CPU: cross-replica
requests resume from the pool's KV pages and state checkpoints, the records name the bytes of each, and every
output equals its reference. Never timings."""

from __future__ import annotations

import pytest

from kvshare.bench.demo_experiments import run_demo_experiments
from kvshare.bench.records import ResultsDir
from kvshare.launch import free_port_block


@pytest.fixture(scope="module")
def cluster():
    from kvshare.launch import Cluster, ClusterConfig

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        c = Cluster(
            ClusterConfig(
                num_replicas=2,
                model="qwen3.5-tiny",
                pool_size="1GiB",
                policy="alternate",
                port=free_port_block(3),
                log_level="WARNING",
                ready_timeout_s=120,
            )
        )
        c.start()
    try:
        yield c
    finally:
        c.stop()


def test_ttft_blocks_and_sessions_run_with_the_hybrid(cluster, tmp_path):
    outcome = run_demo_experiments(cluster, str(tmp_path), scale="smoke", show_progress=False)
    assert outcome.is_complete and set(outcome.runs) == {"ttft", "blocks", "sessions"}
    records = ResultsDir(str(tmp_path)).load()
    cross = [r for r in records if r.experiment == "ttft" and r.condition == "cross"]
    assert cross and all(r.pool_tokens > 0 and r.pool_state_bytes > 0 and r.pool_kv_bytes > 0 for r in cross)
    assert all(r.matches_reference for r in records if r.matches_reference is not None)
    assert any(r.matches_reference for r in records)
    later_turns = [r for r in records if r.experiment == "sessions" and r.condition == "alternate/on" and r.turn]
    assert any(r.pool_state_bytes for r in later_turns)  # a turn on the other replica resumes from the pool
