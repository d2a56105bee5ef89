"""benchmarks/vllm_harness_gpu.py on CPU: its pure parts, and one tiny end-to-end dry run (figures mean nothing here).

On CPU the worker takes the CPU copy path; the run still drives the connector's scheduler and
worker sides in vLLM's order through the hooks, across two fresh replica processes and a pool.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "vllm_harness_gpu.py"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("vllm_harness_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_cases_parse_and_bad_ones_are_refused(harness):
    cases = harness.parse_cases("8b:32768, 32b:128k,tiny:1024")
    assert [(c.preset, c.prompt_tokens) for c in cases] == [("qwen3-8b", 32768), ("qwen3-32b", 131072), ("tiny", 1024)]
    assert [c.name for c in harness.parse_args(["--out", "x"]).case_list] == harness.DEFAULT_CASES.split(",")
    for bad in ("70b:1024", "8b", "8b:100", ""):
        with pytest.raises(ValueError):
            harness.parse_cases(bad)


def test_the_pool_holds_a_case_below_its_eviction_watermark(harness):
    page = 36 << 20  # the 8B shape's page
    mib = harness.pool_mib(page, 131072)
    assert mib % harness.EXTENT_MIB == 0 and 512 * page / (mib << 20) < 0.9


def figures():
    a = {
        "store_s": 0.5,
        "store_again_s": 0.48,
        "store_bytes": 40 << 30,
        "pinned_d2h_s": 0.45,
        "cold_step_s": 9.0,
        "register_s": 1.0,
    }
    b = {
        "load_s": [0.8, 0.5],
        "load_unverified_s": [0.49],
        "compute_s": [0.1, 0.2],
        "step_s": [0.55, 0.6],
        "load_bytes_per_step": 25 << 30,
        "pinned_h2d_s": 0.47,
        "prefix_tokens": 32752,
        "incomplete_loads": 0,
        "load_errors": 0,
        "loaded_tokens": 32752,
        "register_s": 1.0,
    }
    return a, b


def test_a_row_has_every_field_and_the_ratios_of_the_issue(harness):
    a, b = figures()
    logits = harness.compare_logits(torch.ones(3, 5), torch.ones(3, 5))
    row = harness.make_row(harness.Case("8b", 32768), a, b, logits)
    assert set(harness.ROW_FIELDS) <= set(row)
    assert row["load_ratio_vs_pinned"] == pytest.approx(0.47 / 0.5) and row["store_ratio_vs_pinned"] == pytest.approx(
        0.9
    )
    assert row["step_over_bound"] == pytest.approx(0.55 / 0.5) and row["verify_share_of_load"] == pytest.approx(0.02)
    assert row["suffix_tokens"] == 16 and row["tokens_equal"] and row["load_complete"] and row["model"] == "qwen3-8b"
    json.dumps(row)  # plain JSON
    assert harness.table([row]).splitlines()[2].startswith("qwen3-8b 32768 | 53.7 | 57.1 | 0.94")
    error = harness.error_row(harness.Case("32b", 131072), "RuntimeError: out of memory")
    assert set(harness.ROW_FIELDS) <= set(error) and "error: RuntimeError" in harness.table([error])


def test_logits_compared_bitwise_with_the_first_divergence_and_its_gap(harness):
    a = torch.tensor([[0.0, 1.0, 0.0], [2.0, 1.999, 0.0]])
    b = torch.tensor([[0.0, 1.0, 0.0], [1.999, 2.0, 0.0]])
    result = harness.compare_logits(a, b)
    assert not result["tokens_equal"] and not result["logits_bitwise_equal"] and result["first_divergence"] == 1
    assert result["top2_gap_at_divergence"] == pytest.approx(0.001, abs=1e-6)
    assert harness.compare_logits(a, a.clone())["logits_bitwise_equal"]


def test_a_tiny_dry_run_on_cpu_end_to_end(harness, tmp_path):
    assert harness.main(["--out", str(tmp_path), "--cases", "tiny:512", "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "vllm_harness.json").read_text())
    (row,) = report["cases"]
    assert row["error"] is None and set(harness.ROW_FIELDS) <= set(row)
    assert row["prefix_tokens"] == 496 and row["load_complete"] and row["tokens_equal"] and row["logits_bitwise_equal"]
    # the two store-bandwidth passes' two chunks each, then the prompt's
    assert row["raw"]["A"]["stored_chunks"] == 2 + 2 + 2
    assert row["store_again_s"] > 0 and row["raw"]["B"]["phases"]["step"][0]["host_s"]["prepare_inputs"] >= 0
    assert row["store_bytes"] == 2 * 2 << 20  # two pages of the tiny preset (8 layers x 2 x 256 x 2 x 64 x 4 bytes)


def test_cases_past_the_budget_are_skipped_with_a_row(harness, tmp_path, monkeypatch):
    monkeypatch.setattr(
        harness, "run_case", lambda case, device, timeout_s: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    assert (
        harness.main(["--out", str(tmp_path), "--cases", "tiny:512,tiny:1024", "--device", "cpu", "--budget-s", "1e-9"])
        == 1
    )
    rows = json.loads((tmp_path / "vllm_harness.json").read_text())["cases"]
    assert [r["error"].split(":")[0] for r in rows] == ["skipped", "skipped"]
