"""benchmarks/before_after_table.py: a run's built-in cross figure is the median of B's requests that loaded
from the pool, its vLLM cross figure only rows where B reported cached tokens, and each tree's cell is the
median over its rounds with their spread."""

from __future__ import annotations

import json

from tests.benchmarks.loader import load_benchmark

table = load_benchmark("before_after_table")


def record(experiment, condition, ttft_s, pool_tokens=0, role="measure", context=1024):
    return {
        "experiment": experiment,
        "condition": condition,
        "role": role,
        "context_tokens": context,
        "ttft_s": ttft_s,
        "pool_tokens": pool_tokens,
        "error": None,
    }


def write_run(run_dir, records, vllm_rows, load):
    (run_dir / "demo" / "bench").mkdir(parents=True)
    (run_dir / "demo" / "bench" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "vllm").mkdir()
    (run_dir / "vllm" / "ttft.json").write_text(json.dumps({"rows": vllm_rows}))
    (run_dir / "loadavg").write_text(f"{load}\n")


def test_figures_count_only_loads_and_the_table_gives_median_and_spread(tmp_path):
    """Fails when a prime, a cross request that recomputed, or another length is counted as a load."""
    for round_, scale in ((1, 1.0), (2, 2.0), (3, 3.0)):
        records = [
            record("ttft", "cross", 0.1 * scale, pool_tokens=768),
            record("blocks", "on", 0.2 * scale, pool_tokens=768),
            record("blocks", "on", 0.3 * scale, pool_tokens=768),
            record("blocks", "on", 9.0, pool_tokens=0),  # recomputed: no load
            record("blocks", "on", 9.0, role="prime"),
            record("ttft", "cross", 9.0, pool_tokens=256, context=512),
            record("ttft", "cold", 0.5 * scale),
        ]
        rows = [
            {"cross_B": 0.05 * scale, "cross_B_cached": 4064, "cold_A": 2.0},
            {"cross_B": 9.0, "cross_B_cached": 0, "cold_A": 2.0},  # B recomputed
        ]
        write_run(tmp_path / "t0" / f"r{round_}", records, rows, 1.5 * round_)
    figures = table.run_figures(tmp_path / "t0" / "r2")
    assert figures["builtin cross"] == 0.4  # median of 0.2, 0.4, 0.6
    assert figures["vllm cross_B"] == 0.1
    text = table.table(tmp_path, ["before"])
    assert "| builtin cross | 400.0 ms (200.0 - 600.0), 3 |" in text
    assert "| vllm cross_B | 100.0 ms (50.0 - 150.0), 3 |" in text
    assert "| load average | 3.0 (1.5 - 4.5), 3 |" in text
