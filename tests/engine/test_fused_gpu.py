"""The fused element-wise kernels (Triton) on CUDA against the eager code: RMSNorm and SiLU x up within bf16 rounding
(on the H100 they were the eager results bit for bit on random inputs), RoPE as close to float32 as the eager code,
every row independent of how many rows share the call, and an engine with them as close to its float32 self as
without them.

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
def test_rope_is_as_close_to_float32_as_the_eager_code(kernels, tokens, heads):
    """Each product and the sum rounded to bf16 as the eager operators round them; on the H100 the result differed
    from the eager one by one bf16 step in ~23% of elements (the compiler's float32 arithmetic is not torch's), so
    both are held to the float32 result instead."""
    x = _rand(tokens, heads, 128, scale=2.0)
    angles = torch.rand(tokens, 128, generator=torch.Generator().manual_seed(3)) * 100
    cos, sin = angles.cos().to("cuda", torch.bfloat16), angles.sin().to("cuda", torch.bfloat16)
    exact = apply_rope(x.float(), cos.float(), sin.float())
    fused_error = (kernels.rope(x, cos, sin).float() - exact).abs().max().item()
    eager_error = (apply_rope(x, cos, sin).float() - exact).abs().max().item()
    assert fused_error <= 2 * eager_error + 1e-6, (fused_error, eager_error)


def test_silu_mul_within_bf16(kernels):
    gate, up = _rand(4096, 12288, scale=4.0), _rand(4096, 12288, seed=5)
    torch.testing.assert_close(kernels.silu_mul(gate, up), F.silu(gate) * up, rtol=1.6e-2, atol=1e-2)


def test_an_engine_with_them_is_as_close_to_float32_as_without_them():
    """The tiny preset in bf16 with and without the kernels against the same weights in float32 (as
    test_flash_gpu.py holds FlashAttention): the fused engine's logits, greedy choices and KV are within bf16's
    own distance (the eager engine's) of the float32 reference. A random tiny model turns one bf16 step into
    logits up to ~2 apart, so the two bf16 engines are not compared with each other."""
    from kvshare.engine.engine import Engine
    from kvshare.engine.fused import set_fused

    def engine(dtype):
        return Engine(EngineConfig(model="tiny", device="cuda", dtype=dtype, local_cache_bytes=0, max_model_len=4096))

    bf16, exact_engine = engine("bfloat16"), engine("float32")
    assert bf16.fused.kernels is not None, bf16.fused.reason
    assert exact_engine.fused.kernels is None  # float32 keeps the eager code
    c, kernels = bf16.model_config, bf16.fused.kernels
    ids = (torch.arange(1500, device="cuda") * 7) % 250

    def prefill(e):
        dtype = e.model.model.embed_tokens.weight.dtype
        kv = torch.zeros(c.num_layers, 2, c.num_kv_heads, 1600, c.head_dim, device="cuda", dtype=dtype)
        with torch.inference_mode():
            return e.model(ids, kv, 0, all_logits=True), kv

    exact, exact_kv = prefill(exact_engine)
    errors = {}
    for name, chosen in (("fused", kernels), ("eager", None)):
        set_fused(bf16.model, chosen)
        logits, kv = prefill(bf16)
        errors[name] = (
            (logits.float().log_softmax(-1) - exact.log_softmax(-1)).abs().max().item(),
            int((logits.argmax(-1) != exact.argmax(-1)).sum()),
            (kv.float() - exact_kv).abs().max().item(),
        )
    set_fused(bf16.model, kernels)
    (fused_logits, fused_flips, fused_kv), (eager_logits, eager_flips, eager_kv) = errors["fused"], errors["eager"]
    assert fused_logits <= 2 * eager_logits + 0.05, errors
    assert fused_flips <= eager_flips + ids.shape[0] // 50, errors
    assert fused_kv <= 2 * eager_kv + 0.02, errors


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_gpu_than_the_current_one(kernels):
    """Triton launches on the current device: the kernels switch to the tensors' own (a replica on cuda:1 that never
    set its device); fails without the switch (an illegal address, or results of another GPU's memory)."""
    x, w = _rand(64, 4096).to("cuda:1"), _rand(4096).to("cuda:1")
    assert torch.cuda.current_device() == 0
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), rtol=1.6e-2, atol=1e-2)
