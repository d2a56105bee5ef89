"""The bytes, helpers and full-pool levels on CPU, each with a negative control that makes it fail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvshare.validate.bytes_level import run_bytes_level
from kvshare.validate.checked_pool import CheckedPool, PoolSpec
from kvshare.validate.full_pool_level import run_full_pool_level
from kvshare.validate.helpers_level import run_helpers_level
from kvshare.validate.report import CAUGHT, FAIL, PASS, SKIP, ValidateReport


@pytest.fixture(scope="module")
def pool():
    """validate's own pool: 64 MiB in 8 MiB extents, started for the test and removed after it."""
    with CheckedPool(PoolSpec(None, 64 << 20, 8 << 20), "cpu") as s:
        yield s


def test_bytes_level_passes_on_cpu_and_crosses_extent_boundaries(pool):
    result = run_bytes_level(pool)
    assert result.status == PASS, result.rows
    assert result.figures["bytes_checked"] > 0 and result.figures["bytes_wrong"] == 0
    assert result.figures["extent_boundaries"] >= 1
    ran = [r for r in result.rows if r.status == PASS and not r.name.startswith("direct lookup")]
    assert len(ran) == 3 and all(r.name.endswith(" cpu") for r in ran)  # three page sizes, the CPU path
    assert any(r.status == SKIP and "cuda" in r.name for r in result.rows)  # reported skipped, not passed
    assert pool.client.stats()["reservations"] == 0  # scratch pages handed back


def test_bytes_level_fails_on_one_corrupted_byte(pool, monkeypatch):
    """Negative control: a load that gets one byte wrong fails the level."""
    from kvshare.transfer.cpu import CpuTransfer

    original = CpuTransfer.load

    def load_with_a_bad_byte(self, kv, first_chunk, pages):
        handle = original(self, kv, first_chunk, pages)
        t0 = first_chunk * self.layout.chunk_tokens
        kv[0, 0, 0, t0, :1].view(torch.uint8)[0] ^= 0x01  # one bit of the first loaded element
        return handle

    monkeypatch.setattr(CpuTransfer, "load", load_with_a_bad_byte)
    result = run_bytes_level(pool)
    assert result.status == FAIL and result.figures["bytes_wrong"] > 0
    assert all(r.status == FAIL for r in result.rows if r.name.endswith(" cpu"))


def test_helpers_level_passes_on_cpu():
    result = run_helpers_level("cpu")
    assert result.status == PASS, [r for r in result.rows if r.status == FAIL]
    names = {r.name for r in result.rows if r.status == PASS}
    assert {
        "engine [L,2,H,T,D] on cpu",
        "vllm_layout cpu_attn on cpu",
        "vllm_layout flash_attn_5d on cpu",
        "vllm_layout flash_attn NHD on cpu",
    } <= names
    assert result.figures["cases"] >= 144 and result.figures["wrong"] == 0
    if not torch.cuda.is_available():
        assert any(r.status == SKIP and "cuda" in r.name for r in result.rows)


def test_helpers_level_fails_when_a_converter_skips_the_transpose(monkeypatch):
    """Negative control: engine -> pages copying head-major bytes into the token-major page."""
    from kvshare.transfer import layouts

    def no_transpose(chunks, kv, first_token):
        n, _, _, c = chunks.shape[:4]
        window = kv[:, :, :, first_token : first_token + n * c, :]  # [L, 2, H, nC, D]
        heads_first = window.reshape(chunks.shape[1], 2, chunks.shape[4], n, c, -1).permute(3, 0, 1, 2, 4, 5)
        chunks.copy_(heads_first.reshape(chunks.shape))  # chunks split right, but [H, C] bytes taken as [C, H]

    monkeypatch.setattr(layouts, "engine_to_chunks", no_transpose)
    result = run_helpers_level("cpu")
    rows = {r.name: r for r in result.rows}
    assert result.status == FAIL and rows["engine [L,2,H,T,D] on cpu"].status == FAIL
    assert rows["vllm_layout cpu_attn on cpu"].status == PASS  # the others are unaffected


def test_full_pool_level_every_page_then_a_poisoned_page(pool):
    result = run_full_pool_level(pool, 2 << 20, show_progress=False, num_threads=2)
    assert result.status == PASS, result.rows
    assert result.figures["num_pages"] == result.figures["expected_pages"] == 32
    assert set(result.figures["seconds"]) == {"fault_in", "write", "verify"}
    assert {r.name: r.status for r in result.rows}["pin"] == SKIP  # no CUDA: reported, not passed
    bad = run_full_pool_level(pool, 2 << 20, show_progress=False, corrupt_page=7)
    assert bad.status == FAIL and bad.figures["bad_pages"] == [7]
    assert pool.client.stats()["used_bytes"] == 0


def test_report_verdicts_and_exit_code():
    from kvshare.validate.report import LevelResult, Row, verdict_of

    assert verdict_of([Row("a", PASS), Row("b", SKIP)]) == PASS
    assert verdict_of([Row("a", CAUGHT), Row("b", FAIL)]) == FAIL
    assert verdict_of([Row("a", SKIP)]) == SKIP
    report = ValidateReport([LevelResult("bytes", SKIP), LevelResult("helpers", PASS)])
    assert report.ok and report.exit_code == 0
    report.levels.append(LevelResult("service", FAIL, error="boom"))
    assert not report.ok and report.exit_code == 1


def test_cli_runs_levels_writes_json_and_sets_the_exit_code(tmp_path):
    out = tmp_path / "v.json"
    cmd = [
        sys.executable,
        "-m",
        "kvshare",
        "validate",
        "--level",
        "bytes,helpers,full-pool",
        "--device",
        "cpu",
        "--pool-size",
        "64MiB",
        "--extent-size",
        "8MiB",
        "--no-progress",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kvshare validate" in proc.stdout and "all levels passed" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and [lv["level"] for lv in report["levels"]] == ["bytes", "helpers", "full-pool"]
    assert all(lv["status"] == PASS for lv in report["levels"])
    bad = subprocess.run(
        [sys.executable, "-m", "kvshare", "validate", "--level", "bytes,nonsense"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown level" in bad.stderr
