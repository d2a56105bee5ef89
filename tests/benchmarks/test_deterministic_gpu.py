"""benchmarks/deterministic_gpu.py: what its exactness step needs of the GPU (pure)."""

from __future__ import annotations

from kvshare.engine.presets import get_preset
from tests.benchmarks.loader import load_benchmark

H200 = 139 << 30


def test_the_exactness_step_fits_the_8b_shape_not_the_32b_on_an_h200():
    bench = load_benchmark("deterministic_gpu")
    c8, c32 = get_preset("qwen3-8b").config, get_preset("qwen3-32b").config
    assert abs(bench.weights_bytes(c32) / 1e9 - 65.5) < 0.1 and abs(bench.weights_bytes(c8) / 1e9 - 16.4) < 0.1
    assert bench.exactness_misfit(c8, "qwen3-8b", 131072, 64, H200) is None  # two 8B engines at 128k: ~97 GB
    why = bench.exactness_misfit(c32, "qwen3-32b", 32768, 64, H200)  # two 32B engines: ~163 GB at 32k already
    assert why and "sequential" in why
    assert bench.exactness_misfit(c32, "qwen3-32b", 131072, 64, None) is None  # CPU: not the limit
