"""benchmarks/deterministic_gpu.py on CPU: its pure parts, and a tiny end-to-end dry run (figures mean nothing here)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from types import SimpleNamespace

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "deterministic_gpu.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("deterministic_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def event(token_id, logprob, top):
    return SimpleNamespace(token_id=token_id, logprob=logprob, top_logprobs=top)


def test_runs_are_compared_bitwise(probe):
    ref = [event(5, -0.1, {5: -0.1, 6: -3.0}), event(7, -0.5, {7: -0.5, 2: -0.9})]
    assert probe.compare_runs(ref, list(ref)) == {
        "tokens_equal": True,
        "logprobs_equal": True,
        "first_difference": None,
    }
    moved = [ref[0], event(7, -0.5000001, {7: -0.5000001, 2: -0.9})]
    out = probe.compare_runs(ref, moved)
    assert out["tokens_equal"] and not out["logprobs_equal"] and "step 1" in out["first_difference"]
    out = probe.compare_runs(ref, [ref[0], event(2, -0.9, {2: -0.9, 7: -0.5})])
    assert not out["tokens_equal"] and "token 7 (reference) vs 2" in out["first_difference"]


def test_rows_say_what_they_expect_and_whether_they_got_it(probe):
    equal = {"tokens_equal": True, "logprobs_equal": True, "first_difference": None}
    moved = {"tokens_equal": True, "logprobs_equal": False, "first_difference": "step 3"}
    provenance = SimpleNamespace(local_tokens=0, pool_tokens=32512)
    row = probe.make_row("qwen3-8b", 32768, "cross-replica", "deterministic", 256, 0.62, equal, provenance)
    assert set(probe.ROW_FIELDS) <= set(row) and row["passed"] is True and row["pool_tokens"] == 32512
    assert probe.make_row("m", 1, "cross-replica", "deterministic", 256, None, moved)["passed"] is False
    assert probe.make_row("m", 1, "flipped byte, checksums off", "deterministic", 256, None, moved)["passed"] is True
    speed = probe.make_row("m", 1, "speed", "deterministic", 256, 0.6, cold_fast_s=1.0)
    assert speed["passed"] is None and speed["tokens_equal"] is None and speed["cold_fast_s"] == 1.0
    assert probe.speed_ratio(2.0, 4.0) == 0.5 and probe.speed_ratio(None, 1.0) is None


def test_arguments_budget_and_sizes(probe):
    args = probe.parse_args(["--out", "x", "--grids", "2048"])
    assert args.grid_list == [256, 2048] and args.speed_model_list == ["qwen3-32b"]  # the exact runs' grid is timed too
    with pytest.raises(ValueError):
        probe.parse_grids("300", 256)
    clock = iter([0.0, 10.0, 30.0]).__next__
    budget, skipped = probe.Budget(20.0, clock), []
    assert budget.allows("a", skipped) and not budget.allows("b", skipped) and skipped[0].startswith("b (budget")
    assert probe.flip_offset(2) == 2001 and probe.flip_offset(4) == 4003  # the high byte of element 1000
    assert probe.pool_bytes(36 << 20, 128, 2) == 12 << 30


def test_a_tiny_dry_run_end_to_end(probe, tmp_path):
    argv = [
        "--out",
        str(tmp_path),
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--tokens",
        "72",
        "--chunk-tokens",
        "16",
        "--grids",
        "16,32",
        "--speed-models",
        "",
        "--max-tokens",
        "3",
        "--repeats",
        "1",
    ]
    assert probe.main(argv) == 0
    result = json.loads((tmp_path / "deterministic.json").read_text())
    checks = {r["check"]: r for r in result["rows"] if r["check"] != "speed"}
    assert checks["cross-replica"]["tokens_equal"] and checks["cross-replica"]["logprobs_equal"]
    assert checks["cross-replica"]["pool_tokens"] == 64 and checks["local"]["local_tokens"] == 64
    assert (
        checks["flipped byte, checksums off"]["passed"] and not checks["flipped byte, checksums off"]["logprobs_equal"]
    )
    assert (
        checks["flipped byte, checksums on"]["passed"]
        and checks["flipped byte, checksums on"]["checksum_failures"] == 1
    )
    assert [r["grid_tokens"] for r in result["rows"] if r["check"] == "speed"] == [16, 32]
    assert all(result["probes"]["tiny"]["self_test"].values()) and result["passed"]
