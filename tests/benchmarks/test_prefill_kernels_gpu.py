"""benchmarks/prefill_kernels_gpu.py's logic on CPU (KVSHARE_BENCH_DEVICE=cpu): one row per length, naming why
the fused kernels are not there, every timing taken."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_cpu_dry_run_writes_a_row_per_length(tmp_path):
    env = dict(os.environ, KVSHARE_BENCH_DEVICE="cpu", PYTHONPATH=ROOT, KVSHARE_COMMIT="abc1234")
    script = os.path.join(ROOT, "benchmarks", "prefill_kernels_gpu.py")
    argv = [
        sys.executable,
        script,
        "--preset",
        "tiny",
        "--lengths",
        "24",
        "40",
        "--repeats",
        "2",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "prefill_kernels.json").read_text())
    assert [r["prompt_tokens"] for r in rows] == [24, 40]
    for row in rows:
        assert row["fused"] is None and row["fused_reason"] == "not a CUDA device"
        assert len(row["eager_all_s"]) == 2 and row["eager_s"] > 0 and row["commit"] == "abc1234"
