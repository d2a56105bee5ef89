"""The deterministic mode's grid with a FlashAttention kernel as its attention, on CPU through a stand-in kernel
that computes what ``flash_attn_varlen_func`` is documented to compute (tests/engine/test_flash.py): the grid
calls the model's kernel per grid chunk, reuse from a grid boundary stays bitwise equal to the cold prefill, the
kernel build in the namespace names the kernel, and a kernel its self-test finds inexact leaves the grid on SDPA."""

from __future__ import annotations

import pytest
import torch

from kvshare.engine import flash
from kvshare.engine.config import EngineConfig
from kvshare.engine.flash import FlashKernel, FlashPrefill
from kvshare.engine.grid import grid_forward
from kvshare.engine.grid_check import GridCheckFailed, start_grid
from kvshare.engine.presets import build_preset
from tests.engine.test_flash import reference_varlen

GRID = 32


def stand_in(calls: list | None = None, build: str = "stand-in 1.0") -> FlashPrefill:
    return FlashPrefill(FlashKernel("stand-in", lambda **kw: reference_varlen(**kw, calls=calls), {}, build))


def inexact(**kw):
    """An attention whose result depends on where its keys live (their buffer's stride): the self-test's two ways
    (buffers of two capacities) tell it."""
    out = reference_varlen(**kw)
    return out + 1e-3 * (kw["k"].stride(1) % 7)


def test_the_grid_calls_the_models_kernel_and_reuse_from_a_grid_boundary_is_bitwise_the_cold_prefill():
    """Fails when a grid chunk's attention ignores the model's kernel (SDPA: no calls)."""
    model, config, _ = build_preset("tiny", torch.device("cpu"))
    ids = (torch.arange(100) * 7) % 250
    shape = (config.num_layers, 2, config.num_kv_heads, 160, config.head_dim)  # [L, 2, H, T_cap, D]
    calls: list = []
    with torch.inference_mode():
        sdpa = grid_forward(model, ids, torch.zeros(shape), 0, GRID, all_logits=True)
        model.prefill_attention = stand_in(calls)
        cold_kv = torch.zeros(shape)
        cold = grid_forward(model, ids, cold_kv, 0, GRID, all_logits=True)
        assert len(calls) == config.num_layers * 4  # 100 tokens: grid chunks of 32, 32, 32 and a tail of 4
        warm_kv = torch.full((*shape[:3], 224, shape[4]), float("nan"))  # another capacity, garbage past the prefix
        warm_kv[:, :, :, :64] = cold_kv[:, :, :, :64]  # two grid chunks loaded
        warm = grid_forward(model, ids[64:], warm_kv, 64, GRID, all_logits=True)
    assert torch.equal(warm, cold[64:])
    assert torch.equal(warm_kv[:, :, :, :100], cold_kv[:, :, :, :100])
    torch.testing.assert_close(cold, sdpa, rtol=1e-4, atol=1e-4)  # the same attention, by another kernel


def test_the_kernel_build_names_the_attention_and_an_inexact_kernel_leaves_the_grid_on_sdpa():
    """Pages computed with one attention kernel never meet another's (fails when start_grid leaves the attention
    out of the kernel build); a kernel the self-test finds inexact falls back to SDPA rather than refusing the mode
    (fails when start_grid refuses: GridCheckFailed)."""
    model, _, _ = build_preset("tiny", torch.device("cpu"))
    sdpa = start_grid(model, torch.device("cpu"), GRID, GRID // 2).kernel_build
    model.prefill_attention = stand_in()
    with_flash = start_grid(model, torch.device("cpu"), GRID, GRID // 2).kernel_build
    assert with_flash == sdpa + "|attention stand-in stand-in 1.0"
    assert isinstance(model.prefill_attention, FlashPrefill)
    model.prefill_attention = FlashPrefill(FlashKernel("stand-in", inexact, {}, "stand-in 1.0"))
    fallback = start_grid(model, torch.device("cpu"), GRID, GRID // 2)
    assert model.prefill_attention is None and fallback.kernel_build == sdpa


def test_sdpa_that_is_not_exact_still_refuses_the_mode(monkeypatch):
    """The fallback is to SDPA only where SDPA passes: a device where neither is exact refuses the mode."""
    from kvshare.engine import grid_check
    from kvshare.engine.grid_check import CheckResult

    model, _, _ = build_preset("tiny", torch.device("cpu"))
    model.prefill_attention = stand_in()
    monkeypatch.setattr(grid_check, "check_grid", lambda *a: [CheckResult("attention", False, "differs")])
    with pytest.raises(GridCheckFailed, match="attention: differs"):
        start_grid(model, torch.device("cpu"), GRID, GRID // 2)
    assert model.prefill_attention is None


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """The engine's choice of attention as on a GPU with a FlashAttention library: the stand-in kernel."""
    monkeypatch.setattr(flash, "flash_unfit", lambda *a: None)

    def use(varlen):
        kernel = FlashKernel("stand-in", varlen, {}, "stand-in 1.0")
        monkeypatch.setattr(flash, "KERNEL_LOADERS", (("stand_in", lambda: kernel),))

    return use


def test_a_deterministic_engine_runs_the_kernel_on_its_grid_and_reuses_exactly(flash_on_cpu):
    from kvshare.engine.engine import Engine, RequestOptions, SamplingParams

    flash_on_cpu(reference_varlen)
    engine = Engine(EngineConfig(model="tiny", chunk_tokens=16, deterministic=True, grid_tokens=32))
    try:
        assert engine.attention.name == "stand-in"
        assert engine.namespace.kernel_build.endswith("|attention stand-in stand-in 1.0")
        ids = [int(i) for i in (torch.arange(150) * 13) % 250]
        params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)
        cold = list(engine.generate(ids, params, RequestOptions(use_pool=False, use_local_cache=False)))
        list(engine.generate(ids[:80], params))  # the local cache holds the first 64 tokens: two grid chunks
        warm = list(engine.generate(ids, params))
        assert warm[0].provenance.local_tokens == 64
        assert [(e.token_id, e.top_logprobs) for e in warm] == [(e.token_id, e.top_logprobs) for e in cold]
    finally:
        engine.close()


def test_a_deterministic_engine_whose_kernel_is_inexact_says_it_runs_sdpa(flash_on_cpu):
    from kvshare.engine.engine import Engine

    flash_on_cpu(inexact)
    engine = Engine(EngineConfig(model="tiny", chunk_tokens=16, deterministic=True, grid_tokens=32))
    try:
        assert engine.attention.name == "sdpa" and "not exact" in engine.attention.reason
        assert engine.model.prefill_attention is None and "|attention" not in engine.namespace.kernel_build
    finally:
        engine.close()


def test_the_last_layer_runs_for_the_last_token_alone_and_its_logits_are_the_cold_prefills():
    """Without all_logits the grid's last layer writes every token's K/V but attends and runs its MLP for the
    last token alone: its logits are what all_logits gives for that token (fails when the row or its position is
    wrong), bitwise equal from a grid boundary's reuse and cold, and the KV is the same either way."""
    model, config, _ = build_preset("tiny", torch.device("cpu"))
    ids = (torch.arange(100) * 11) % 250
    shape = (config.num_layers, 2, config.num_kv_heads, 160, config.head_dim)
    rows: list[int] = []
    last_mlp = model.model.layers[-1].mlp
    hook = last_mlp.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    try:
        with torch.inference_mode():
            every = grid_forward(model, ids, torch.zeros(shape), 0, GRID, all_logits=True)
            rows.clear()
            cold_kv = torch.zeros(shape)
            cold = grid_forward(model, ids, cold_kv, 0, GRID)
            assert rows == [1]  # one row through the last MLP, not four grid chunks of 32
            warm_kv = torch.full((*shape[:3], 224, shape[4]), float("nan"))
            warm_kv[:, :, :, :64] = cold_kv[:, :, :, :64]
            warm = grid_forward(model, ids[64:], warm_kv, 64, GRID)
            full_kv = torch.zeros(shape)
            grid_forward(model, ids, full_kv, 0, GRID, all_logits=True)
    finally:
        hook.remove()
    assert torch.equal(warm, cold)
    assert torch.equal(warm_kv[:, :, :, :100], cold_kv[:, :, :, :100])
    assert torch.equal(cold_kv[:, :, :, :100], full_kv[:, :, :, :100])  # the last layer's K/V written as before
    torch.testing.assert_close(cold, every[-1:], rtol=1e-4, atol=1e-4)
