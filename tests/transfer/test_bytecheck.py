"""The byte check as a library: it passes on the real paths and fails on a broken one."""

from __future__ import annotations

import pytest
import torch

from kvshare.transfer.bytecheck import make_cases, run_bytecheck
from kvshare.transfer.roundtrip import ByteCheckConfig
from tests.transfer.helpers import EXTENT_BYTES, LAYOUTS


def test_bytecheck_passes_and_crosses_extent_boundaries(client):
    report = run_bytecheck(client, ByteCheckConfig(layout=LAYOUTS["bf16"], cuda=False))
    assert report.ok, report.table()
    assert report.extent_boundaries >= 1 and report.num_pages * LAYOUTS["bf16"].page_bytes > EXTENT_BYTES
    (cpu,) = report.results
    assert cpu.path == "cpu" and cpu.num_cases >= 5 and cpu.bytes_checked > 0 and cpu.mismatched_bytes == 0
    assert "cpu" in report.table()
    stats = client.stats()
    assert stats["writing"] == 0 and stats["reservations"] == 0  # scratch pages were aborted, nothing stays


def test_bytecheck_reports_cuda_as_skipped_without_a_gpu(client):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    report = run_bytecheck(client, ByteCheckConfig(layout=LAYOUTS["f32"]))
    assert report.ok and [r.skipped for r in report.results] == ["", "no CUDA device"]


def test_bytecheck_catches_a_broken_transfer(client, monkeypatch):
    """Negative control: a store that forgets the token/head transpose is reported, not passed."""
    from kvshare.transfer import cpu as cpu_module

    def broken_engine_to_chunks(chunks, kv, first_token):
        n, _, _, c = chunks.shape[:4]
        window = kv[:, :, :, first_token : first_token + n * c, :]
        chunks.view(-1).copy_(window.permute(3, 0, 1, 2, 4).reshape(-1))  # token-major, but heads not transposed

    monkeypatch.setattr(cpu_module, "engine_to_chunks", broken_engine_to_chunks)
    report = run_bytecheck(client, ByteCheckConfig(layout=LAYOUTS["f32"], cuda=False))
    assert not report.ok and report.results[0].mismatched_bytes > 0
    assert "FAIL" in report.table()


def test_cases_cover_boundaries_shift_scatter_and_single_page():
    page, extent = 100, 400
    offsets = [i * page for i in range(10)]
    cases = {name: (first, offs) for name, first, offs in make_cases(offsets, extent, seed=0)}
    assert cases["runs"] == (0, offsets)
    assert cases["single"] == (5, [900])
    assert cases["shifted"][0] == 3 and sorted(cases["scattered"][1]) == offsets
    assert [n for n in cases if n.startswith("extent@")] == ["extent@400", "extent@800"]
    assert cases["extent@400"][1] == [200, 300, 400, 500]
