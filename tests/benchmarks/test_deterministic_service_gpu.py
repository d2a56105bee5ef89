"""A CPU dry run of benchmarks/deterministic_service_gpu.py: kvshare up --deterministic, tiny model, short prompts."""

from __future__ import annotations

import json

from tests.benchmarks.loader import load_benchmark



def load_bench():
    return load_benchmark("deterministic_service_gpu")


def test_cases_parse_and_estimates_follow_the_h200_figures():
    bench = load_bench()
    assert bench.parse_pairs("8b:32768,32b:131072") == [("qwen3-8b", 32768), ("qwen3-32b", 131072)]
    assert abs(bench.cold_s("qwen3-8b", 32768, "cuda") - 1.9 / 0.8) < 1e-9
    assert abs(bench.cold_s("qwen3-8b", 131072, "cuda") - 13.0 / 0.8) < 0.1
    assert abs(bench.cold_s("qwen3-32b", 32768, "cuda") - 3.3 * 1.9 / 0.8) < 1e-9


def test_dry_run_on_cpu_is_exact_and_the_flipped_byte_fails(tmp_path):
    bench = load_bench()
    rc = bench.main(["--out", str(tmp_path), "--device", "cpu", "--model", "tiny", "--tokens", "512",
                     "--chunk-tokens", "128", "--max-tokens", "8", "--turns", "3", "--turn-tokens", "128",
                     "--time-budget", "300"])
    out = json.loads((tmp_path / "deterministic_service.json").read_text())
    assert rc == 0 and out["passed"] and not out["errors"] and not out["skipped"], out
    rows = {r["case"]: r for r in out["rows"]}
    assert set(rows) == {"prime", "cross", "local", "flipped_byte_control",
                         "session_turn_0", "session_turn_1", "session_turn_2"}
    for name in ("cross", "local", "session_turn_1", "session_turn_2"):
        r = rows[name]
        assert r["tokens_equal"] and r["logprobs_equal"] and r["first_difference"] is None and r["deterministic"]
    assert rows["cross"]["pool_tokens"] == 384 and rows["cross"]["replica"] == "replica1"
    assert rows["local"]["local_tokens"] == 384
    assert [rows[f"session_turn_{k}"]["replica"] for k in range(3)] == ["replica0", "replica1", "replica0"]
    control = rows["flipped_byte_control"]
    assert control["expected"] == "differ" and control["passed"] and control["pool_tokens"] == 384
    assert not (control["tokens_equal"] and control["logprobs_equal"]) and control["first_difference"]["step"] == 0
