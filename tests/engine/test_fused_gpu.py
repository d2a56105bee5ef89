"""The fused element-wise kernels (Triton) on CUDA against the eager code: RoPE bit for bit, RMSNorm and SiLU x up
within bf16 rounding, every row independent of how many rows share the call, and an engine's greedy tokens and
logits with them against the same engine without them.

Skipped without CUDA or Triton. On the GPU machine: ``python -m pytest -q -m gpu tests/engine/test_fused_gpu.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from kvshare.engine.config import EngineConfig
from kvshare.engine.model import apply_rope, rms_norm

HAS_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]


@pytest.fixture(scope="module")
def kernels():
    from kvshare.engine.fused import TritonKernels

    return TritonKernels()


def _rand(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("rows, dim", [(4099, 4096), (70000, 128), (1, 5120)])
def test_rms_norm_within_bf16_and_each_row_alone_equals_it_in_a_batch(kernels, rows, dim):
    x, w = _rand(rows, dim, scale=3.0), _rand(dim, seed=1)
    got = kernels.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, rms_norm(x, w, 1e-6), rtol=1.6e-2, atol=1e-2)
    for a, b in ((0, 1), (rows // 3, rows // 3 + 17), (rows - 1, rows)):
        assert torch.equal(kernels.rms_norm(x[a:b], w, 1e-6), got[a:b])


def test_rms_norm_of_heads_as_the_qk_norm_calls_it(kernels):
    q, w = _rand(300, 32, 128, scale=2.0), _rand(128, seed=2)
    torch.testing.assert_close(kernels.rms_norm(q, w, 1e-6), rms_norm(q, w, 1e-6), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("tokens, heads", [(4096, 32), (1, 8), (333, 5)])
def test_rope_is_the_eager_result_bit_for_bit(kernels, tokens, heads):
    x = _rand(tokens, heads, 128, scale=2.0)
    angles = torch.rand(tokens, 128, generator=torch.Generator().manual_seed(3)) * 100
    cos, sin = angles.cos().to("cuda", torch.bfloat16), angles.sin().to("cuda", torch.bfloat16)
    assert torch.equal(kernels.rope(x, cos, sin), apply_rope(x, cos, sin))


def test_silu_mul_within_bf16(kernels):
    gate, up = _rand(4096, 12288, scale=4.0), _rand(4096, 12288, seed=5)
    torch.testing.assert_close(kernels.silu_mul(gate, up), F.silu(gate) * up, rtol=1.6e-2, atol=1e-2)


def test_an_engine_with_them_computes_the_eager_engines_logits():
    """A prefill of the tiny preset (bf16) with and without the kernels, same weights: logits within bf16 noise
    and the same greedy choice at (nearly) every position; the engine chose them by itself."""
    from kvshare.engine.engine import Engine
    from kvshare.engine.fused import set_fused

    engine = Engine(
        EngineConfig(model="tiny", device="cuda", dtype="bfloat16", local_cache_bytes=0, max_model_len=4096)
    )
    assert engine.fused.kernels is not None, engine.fused.reason
    c, kernels = engine.model_config, engine.fused.kernels
    ids = torch.randint(4, 250, (1500,), generator=torch.Generator().manual_seed(7)).to("cuda")
    kv = torch.zeros(c.num_layers, 2, c.num_kv_heads, 1600, c.head_dim, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        fused = engine.model(ids, kv.clone(), 0, all_logits=True)
        set_fused(engine.model, None)
        try:
            eager = engine.model(ids, kv.clone(), 0, all_logits=True)
        finally:
            set_fused(engine.model, kernels)
    torch.testing.assert_close(fused, eager, rtol=5e-2, atol=5e-2)
    assert (fused.argmax(-1) == eager.argmax(-1)).float().mean().item() > 0.99
