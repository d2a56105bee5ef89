"""benchmarks/transfer_gpu.py's own logic, run on CPU under the fake CUDA (its figures mean nothing here)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import torch

from tests.transfer import fake_cuda

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "transfer_gpu.py"


def test_bench_script_runs_end_to_end_under_the_fake(monkeypatch, tmp_path):
    fake = fake_cuda.FakeCuda()
    fake_cuda.install(monkeypatch, fake)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    spec = importlib.util.spec_from_file_location("transfer_gpu", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    argv = [
        "--out",
        str(tmp_path),
        "--models",
        "8b",
        "--tokens",
        "256,512",
        "--repeats",
        "1",
        "--extent-size",
        "64MiB",
        "--no-bytecheck",
    ]
    assert bench.main(argv) == 0
    results = json.loads((tmp_path / "transfer_gpu.json").read_text())
    assert [(r["tokens"], r["method"]) for r in results["runs"]] == [
        (256, "memcpy2d"),
        (256, "torch"),
        (512, "memcpy2d"),
        (512, "torch"),
    ]
    assert all(r["exact"] and "error" not in r for r in results["runs"])
    assert "OVERALL: OK" in (tmp_path / "transfer_gpu.txt").read_text()
    assert fake.registered == {}  # arena and reference buffers unregistered
