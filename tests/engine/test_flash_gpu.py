"""FlashAttention's varlen prefill on CUDA against SDPA: attention outputs, an engine's logits and KV within bf16
tolerance, run-to-run bitwise equality, and the deterministic mode running it on its grid: bitwise stable, and a
prefix reused from a grid boundary bitwise equal to the cold prefill.

Skipped without CUDA or without a FlashAttention library (vLLM's vllm_flash_attn or flash_attn). Run on the GPU
machine with ``python -m pytest -q -m gpu tests/engine/test_flash_gpu.py`` (with the vLLM bundle's environment
sourced for vllm_flash_attn).
"""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.flash import FlashPrefill, find_flash_kernel, select_attention
from kvshare.engine.model import attend

HAS_CUDA = torch.cuda.is_available()
KERNEL = find_flash_kernel()[0] if HAS_CUDA else None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA"),
    pytest.mark.skipif(KERNEL is None, reason="needs vllm.vllm_flash_attn or flash_attn"),
]
BF16_ATOL = 2e-2  # outputs are convex combinations of N(0, 1) values; bf16 keeps 8 bits of mantissa


@pytest.mark.parametrize("start, num_queries", [(0, 4096), (3072, 1000), (8192, 257)])
def test_flash_prefill_equals_sdpa_within_bf16(start, num_queries):
    g = torch.Generator(device="cuda").manual_seed(num_queries)
    q = torch.randn(32, num_queries, 128, device="cuda", dtype=torch.bfloat16, generator=g)  # [Hq, T, D]
    kv = torch.randn(2, 8, start + num_queries + 64, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    end = start + num_queries
    prefill = FlashPrefill(KERNEL)
    got = prefill(q, kv[0, :, :end], kv[1, :, :end], start)
    expected = attend(q, kv[0, :, :end], kv[1, :, :end], start)
    exact = attend(q.float(), kv[0, :, :end].float(), kv[1, :, :end].float(), start)
    assert (got.float() - expected.float()).abs().max().item() < BF16_ATOL
    assert (got.float() - exact).abs().max().item() < BF16_ATOL
    again = prefill(q, kv[0, :, :end], kv[1, :, :end], start)
    assert torch.equal(got, again)  # num_splits=1 (vLLM's kernels) or FA2's varlen: one result per input


def _engine(attention: str, dtype: str = "bfloat16", **kw):
    from kvshare.engine.engine import Engine

    defaults = {"model": "tiny", "device": "cuda", "local_cache_bytes": 0, "max_model_len": 4096}
    return Engine(EngineConfig(**{**defaults, "dtype": dtype, "attention": attention, **kw}))


def _prefill(engine, ids: torch.Tensor, start_split: int | None = None):
    """All logits of a cold prefill of ``ids`` (or of its suffix over a cached prefix) and the KV it wrote."""
    c = engine.model_config
    dtype = engine.model.model.embed_tokens.weight.dtype
    kv = torch.zeros(c.num_layers, 2, c.num_kv_heads, ids.shape[0] + 64, c.head_dim, device="cuda", dtype=dtype)
    with torch.inference_mode():
        if start_split is None:
            return engine.model(ids, kv, 0, all_logits=True), kv
        engine.model(ids[:start_split], kv, 0)
        return engine.model(ids[start_split:], kv, start_split, all_logits=True), kv


def test_an_engine_on_flash_attention_is_as_close_to_float32_as_on_sdpa():
    """bf16 on FlashAttention and bf16 on SDPA against the same model in float32: FlashAttention's logits, greedy
    choices and KV are within bf16's own distance (SDPA's) of the float32 reference."""
    flash_engine, sdpa_engine, exact_engine = _engine("flash"), _engine("sdpa"), _engine("sdpa", dtype="float32")
    assert flash_engine.attention.name == KERNEL.name and sdpa_engine.attention.prefill is None
    ids = (torch.arange(1500, device="cuda") * 7) % 250
    for split in (None, 1024):
        exact, exact_kv = _prefill(exact_engine, ids, split)
        reference = exact.log_softmax(-1)
        errors = {}
        for name, engine in (("flash", flash_engine), ("sdpa", sdpa_engine)):
            logits, kv = _prefill(engine, ids, split)
            errors[name] = (
                (logits.float().log_softmax(-1) - reference).abs().max().item(),
                int((logits.argmax(-1) != exact.argmax(-1)).sum()),
                (kv.float() - exact_kv).abs().max().item(),
            )
        (flash_logits, flash_flips, flash_kv), (sdpa_logits, sdpa_flips, sdpa_kv) = errors["flash"], errors["sdpa"]
        assert flash_logits <= 2 * sdpa_logits + 0.05, errors
        assert flash_flips <= sdpa_flips + ids.shape[0] // 50, errors
        assert flash_kv <= 2 * sdpa_kv + 0.02, errors


def test_the_deterministic_mode_runs_flash_on_its_grid_bitwise_stable_and_reuse_exact():
    engine = _engine("auto", deterministic=True, chunk_tokens=256, grid_tokens=256, local_cache_bytes=64 << 20)
    assert engine.attention.name == KERNEL.name and isinstance(engine.model.prefill_attention, FlashPrefill)
    assert f"|attention {KERNEL.name} " in engine.namespace.kernel_build
    from kvshare.engine.engine import RequestOptions, SamplingParams

    ids = [int(i) for i in (torch.arange(1300) * 11) % 250]
    params = SamplingParams(max_tokens=8, logprobs=2)
    cold = [
        [(e.token_id, e.logprob) for e in engine.generate(ids, params, RequestOptions(use_local_cache=False))]
        for _ in range(2)
    ]
    assert cold[0] == cold[1]
    list(engine.generate(ids[:1100], params))  # the local cache: 4 grid chunks of 256 tokens
    warm = list(engine.generate(ids, params))
    assert warm[0].provenance.local_tokens == 1024
    assert [(e.token_id, e.logprob) for e in warm] == cold[0]


def test_auto_chooses_flash_attention_here():
    chosen = select_attention("auto", torch.device("cuda"), torch.bfloat16, 128)
    assert chosen.name == KERNEL.name and chosen.prefill is not None
