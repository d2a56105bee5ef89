"""benchmarks/service_ttft_gpu.py: its plan for the H200 shapes (pure) and a CPU dry run through kvshare up."""

from __future__ import annotations

import argparse
import json
import mmap

from tests.benchmarks.loader import load_benchmark

GiB = 1 << 30


def load_bench():
    return load_benchmark("service_ttft_gpu")


def plan_args(**kw) -> argparse.Namespace:
    base = dict(device="cuda", layout="auto", max_tokens=16, pool_size=None, local_cache_size=None)
    return argparse.Namespace(**{**base, **kw})


def test_plans_for_the_h200_cases():
    bench = load_bench()
    assert bench.parse_cases("8b:262144,32b:32768") == [("qwen3-8b", 262144), ("qwen3-32b", 32768)]
    h200 = 139 * GiB
    p256 = bench.plan_case("qwen3-8b", 262144, plan_args(), h200)
    assert p256["prompt_tokens"] == 262144 - 16 and p256["context"] == 262144
    assert abs(p256["kv_bytes"] / GiB - 36.0) < 0.01 and p256["pool_size"] < 100 * GiB  # host RAM: 128 GiB
    assert p256["layout"] == "together" and p256["local_cache"] == 0  # two 36 GiB local caches do not fit
    p128 = bench.plan_case("qwen3-8b", 131072, plan_args(), h200)
    assert p128["layout"] == "together" and p128["local_cache"] > p128["kv_bytes"]
    for tokens in (32768, 131072):  # two 61 GiB replicas never fit one H200
        assert bench.plan_case("qwen3-32b", tokens, plan_args(), h200)["layout"] == "sequential"
    assert bench.estimate_s(p256, 2) < 540  # one command of at most 10 minutes on the GPU machine


def test_dry_run_on_cpu_through_kvshare_up(tmp_path):
    bench = load_bench()
    rc = bench.main(
        [
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--cases",
            "tiny:1024",
            "--time-budget",
            "400",
            "--pool-arg=--extent-size=64MiB",
            "--replica-arg=--staging-buffers=3",
        ]
    )
    # the pool and replica arguments reach what kvshare up starts (a bad one fails the start)
    rows = json.loads((tmp_path / "service_ttft.json").read_text())
    assert rc == 0 and [(r["path"], r["first_request"]) for r in rows] == [
        ("router", True),
        ("router", False),
        ("replica", False),
        ("replica", False),
    ]
    assert all(r["pool_args"] == ["--extent-size=64MiB"] for r in rows)
    assert all(r["replica_args"] == ["--staging-buffers=3"] for r in rows)
    assert all(r["arena_page_bytes"] in (mmap.PAGESIZE, 2 << 20) for r in rows)  # read from the pool's stats
    for r in rows:
        assert r["cold_replica"] != r["cross_replica"] and r["pool_tokens"] == 768 and r["computed_tokens"] == 256
        assert r["verified"] and r["tokens_equal"] and r["local_s"] is not None and r["bound_s"] > 0
        assert r["output_verdict"] == "equal" and r["divergence_step"] is None
        assert r["timeline"]["load_end"] is not None and r["timeline"]["first_token_written"] >= r["timeline"]["parse"]


def test_plans_for_the_hybrid_shapes_on_an_h100():
    bench = load_bench()
    assert bench.parse_cases("27b:131072,9b:32768") == [("qwen3.5-27b", 131072), ("qwen3.5-9b", 32768)]
    h100 = 78 * GiB
    for tokens in (32768, 131072):
        plan = bench.plan_case("qwen3.5-27b", tokens, plan_args(), h100)
        assert plan["layout"] == "sequential"  # 50 GiB of weights: one replica at a time
        assert bench.estimate_s(plan, 1) < 540  # one path: one command of at most 9 minutes
        assert plan["pool_size"] > plan["kv_bytes"] + 8 * 146 * (1 << 20)  # the checkpoints' room
    assert 49 * GiB < bench.weights_bytes(bench_config("qwen3.5-27b")) < 52 * GiB  # 26.9B parameters in bf16


def bench_config(model: str):
    from kvshare.engine.presets import PRESETS

    return PRESETS[model].config


def test_dry_run_of_the_hybrid_one_replica_at_a_time(tmp_path):
    """B starts in A's place against the same pool and resumes A's prompt from its KV pages and the state
    checkpoint beside them; the rows name the bytes of each, the commit, the machine and the command."""
    bench = load_bench()
    args = ["--out", str(tmp_path), "--device", "cpu", "--cases", "tiny35:1024", "--layout", "sequential"]
    rc = bench.main([*args, "--paths", "replica", "--time-budget", "400"])
    rows = json.loads((tmp_path / "service_ttft.json").read_text())
    state = bench.state_bytes_of(bench_config("qwen3.5-tiny"))
    assert rc == 0 and len(rows) == 2 and rows[0]["first_request"]
    for r in rows:
        assert r["pool_tokens"] == 768 and r["kv_bytes"] == 768 * bench_config("qwen3.5-tiny").kv_bytes_per_token
        assert (r["state_bytes"], r["checkpoints_loaded"]) == (state, 1)
        assert r["bound_s"] > 0 and r["tokens_equal"] and r["output_verdict"] == "equal"
        assert r["hardware"] and r["command"].endswith("--time-budget 400") and "commit" in r
