"""benchmarks/deterministic_service_gpu.py (and its plan, deterministic_service_plan.py): its plans for the H200
shapes (pure) and CPU dry runs of both layouts."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.loader import load_benchmark

GiB = 1 << 30
H200_FREE = int(138.5 * GiB)


def load_bench():
    return load_benchmark("deterministic_service_gpu")


def plans(bench, *argv: str, free: int | None = H200_FREE) -> dict:
    args = bench.parse_args(["--out", "/tmp/unused", *argv])
    models = dict.fromkeys(m for m, _ in [*args.case_list, *args.session_list])
    return {m: bench.plan_model(args, m, free) for m in models}


def total_s(plan) -> float:
    return plan.start_s + plan.swap_s + sum(s.a_s + s.b_s for s in plan.steps)


def test_cases_parse_and_estimates_follow_the_h200_figures():
    bench, estimates = load_bench(), load_benchmark("deterministic_service_plan")
    assert bench.parse_pairs("8b:32768,32b:131072") == [("qwen3-8b", 32768), ("qwen3-32b", 131072)]
    assert abs(estimates.cold_s("qwen3-8b", 32768, "cuda") - 1.9 / 0.8) < 1e-9
    assert abs(estimates.cold_s("qwen3-8b", 131072, "cuda") - 13.0 / 0.8) < 0.1
    assert abs(estimates.cold_s("qwen3-32b", 32768, "cuda") - 5.6 / 0.8) < 0.01
    assert abs(estimates.cold_s("qwen3-32b", 131072, "cuda") - 46.0 / 0.8) < 0.1
    assert estimates.reused_tokens(32768, 2048) == 30720 and estimates.reused_tokens(32768, 2048, 7281) == 6144


def test_the_32b_shape_runs_sequential_and_the_8b_together_on_an_h200():
    bench = load_bench()
    p32 = plans(bench, "--cases", "32b:32768,32b:131072", "--sessions", "32b:32768")["qwen3-32b"]
    kv = 262144  # bytes per token of the 32B shape
    assert p32.layout == "sequential" and p32.swap_s > 0
    assert 32768 * kv < p32.local_cache_bytes < 30 * GiB  # the 32k prompt whole; most of the 128k one
    assert [s.kind for s in p32.steps] == ["case", "control", "case"]  # the control on the shortest case
    assert p32.skipped and "together" in p32.skipped[0]  # sessions need A and B at once
    held = (32768 + 32768 + 131072) * kv  # every A-phase prompt stays pooled until B reads it
    assert int(p32.pool_size.removesuffix("GiB")) * GiB * 0.9 > held
    assert total_s(p32) < 480  # one device command, with room for the estimates' error
    p8 = plans(bench, "--cases", "8b:131072", "--sessions", "")["qwen3-8b"]
    assert p8.layout == "together" and p8.swap_s == 0 and p8.local_cache_bytes > 131072 * 147456
    assert total_s(p8) < 300
    forced = plans(bench, "--cases", "32b:131072", "--layout", "together")["qwen3-32b"]
    assert forced.layout is None and "fits" in forced.reason
    cpu = plans(bench, "--cases", "tiny:512", "--layout", "sequential", free=None)["tiny"]
    assert cpu.layout == "sequential" and cpu.pool_size == "3GiB"


def test_a_cluster_spec_names_its_layout():
    spec_module = load_benchmark("up_cluster")
    with pytest.raises(ValueError, match="layout"):
        spec_module.ClusterSpec(layout="apart", model="tiny", device="cpu", pool_size="1GiB")


def run_dry(bench, tmp_path, *extra: str) -> tuple[int, dict]:
    rc = bench.main(
        [
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--tokens",
            "512",
            "--chunk-tokens",
            "128",
            "--max-tokens",
            "8",
            "--turns",
            "3",
            "--turn-tokens",
            "128",
            "--time-budget",
            "300",
            *extra,
        ]
    )
    return rc, json.loads((tmp_path / "deterministic_service.json").read_text())


def check_reuse_rows(rows: dict, b_name: str) -> None:
    for name in ("cross", "local"):
        r = rows[name]
        assert r["tokens_equal"] and r["logprobs_equal"] and r["first_difference"] is None and r["deterministic"]
    assert rows["cross"]["pool_tokens"] == 384 and rows["cross"]["replica"] == b_name
    assert rows["local"]["local_tokens"] == 384
    control = rows["flipped_byte_control"]
    assert control["expected"] == "differ" and control["passed"] and control["pool_tokens"] == 384
    assert control["replica"] == b_name
    assert not (control["tokens_equal"] and control["logprobs_equal"]) and control["first_difference"]["step"] == 0


def test_dry_run_on_cpu_together_is_exact_and_the_flipped_byte_fails(tmp_path):
    rc, out = run_dry(load_bench(), tmp_path)
    assert rc == 0 and out["passed"] and not out["errors"] and not out["skipped"], out
    rows = {r["case"]: r for r in out["rows"]}
    assert set(rows) == {
        "prime",
        "cross",
        "local",
        "flipped_byte_control",
        "session_turn_0",
        "session_turn_1",
        "session_turn_2",
    }
    check_reuse_rows(rows, "replica1")
    for name in ("session_turn_1", "session_turn_2"):
        assert rows[name]["tokens_equal"] and rows[name]["logprobs_equal"] and rows[name]["deterministic"]
    assert [rows[f"session_turn_{k}"]["replica"] for k in range(3)] == ["replica0", "replica1", "replica0"]


def test_dry_run_on_cpu_sequential_b_replaces_a(tmp_path):
    rc, out = run_dry(load_bench(), tmp_path, "--layout", "sequential")
    assert rc == 0 and out["passed"] and not out["errors"], out
    assert out["skipped"] == ["tiny session 512 (a session needs A and B up at once: the together layout)"]
    rows = {r["case"]: r for r in out["rows"]}
    assert set(rows) == {"prime", "cross", "local", "flipped_byte_control"}
    assert {r["layout"] for r in out["rows"]} == {"sequential"}
    check_reuse_rows(rows, "replica-B")
    assert rows["prime"]["replica"] == rows["local"]["replica"] == "replica-A"
    assert set(out["clusters"][0]["commands"]) == {"pool", "router", "A", "B"} and out["clusters"][0]["swap_s"] > 0
