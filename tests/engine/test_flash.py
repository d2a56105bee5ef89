"""kvshare.engine.flash on CPU: the choice of prefill attention falls back to SDPA cleanly, and the varlen call's
layout (token-major views, cu_seqlens, causal aligned to the lower right) matches SDPA, through a stand-in kernel
that computes what FlashAttention's documentation says ``flash_attn_varlen_func`` computes."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvshare.engine import flash
from kvshare.engine.config import EngineConfig
from kvshare.engine.flash import AttentionUnavailable, FlashKernel, FlashPrefill, select_attention
from kvshare.engine.model import attend
from kvshare.engine.presets import build_preset

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, calls=None, **extra):
    """FlashAttention's documented contract: q [Tq, Hq, D], k/v [Tk, H, D], GQA by head groups, causal aligned
    to the bottom right; -> [Tq, Hq, D]. One sequence per call here."""
    assert cu_seqlens_q.tolist() == [0, q.shape[0]] and cu_seqlens_k.tolist() == [0, k.shape[0]]
    assert (max_seqlen_q, max_seqlen_k) == (q.shape[0], k.shape[0]) and causal
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    if calls is not None:
        calls.append(extra)
    mask = causal_lower_right(q.shape[0], k.shape[0])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1).contiguous()


def stand_in(calls: list | None = None) -> FlashPrefill:
    return FlashPrefill(FlashKernel("stand-in", lambda **kw: reference_varlen(**kw, calls=calls), {"num_splits": 1}))


@pytest.mark.parametrize("start, num_queries", [(0, 37), (40, 23), (64, 1)])
def test_the_varlen_call_equals_sdpa_cold_and_over_a_cached_prefix(start, num_queries):
    g = torch.Generator().manual_seed(start + num_queries)
    q = torch.randn(8, num_queries, 16, generator=g)  # [Hq, T, D]
    kv = torch.randn(2, 2, 128, 16, generator=g)  # the engine's head-major [2, H, T_cap, D]
    end = start + num_queries
    calls: list = []
    got = stand_in(calls)(q, kv[0, :, :end], kv[1, :, :end], start)
    assert got.shape == (8, num_queries, 16)
    torch.testing.assert_close(got, attend(q, kv[0, :, :end], kv[1, :, :end], start), rtol=1e-5, atol=1e-5)
    assert calls == [{"num_splits": 1}]  # the kernel's own arguments pass through


def test_the_model_runs_its_prefill_through_the_chosen_kernel_and_gets_sdpas_logits():
    """Fails when DecoderLayer ignores ``prefill_attention`` (no calls) or hands it a one-query step."""
    model, config, _ = build_preset("tiny", torch.device("cpu"))
    ids = torch.arange(90) % 250
    kv_shape = (config.num_layers, 2, config.num_kv_heads, 128, config.head_dim)
    with torch.inference_mode():
        expected = model(ids, torch.zeros(kv_shape), 0, all_logits=True)
        kv_cold = torch.zeros(kv_shape)
        model(ids[:64], kv_cold, 0)
        expected_last = model(ids[64:], kv_cold, 64)
        calls: list = []
        model.prefill_attention = stand_in(calls)
        got = model(ids, torch.zeros(kv_shape), 0, all_logits=True)
        assert len(calls) == config.num_layers
        kv = torch.zeros(kv_shape)
        model(ids[:64], kv, 0)
        calls.clear()
        last = model(ids[64:], kv, 64)  # a suffix over a cached prefix; the last layer attends for one query
        assert len(calls) == config.num_layers - 1
        calls.clear()
        model(ids[90:91], kv, 90)  # a decode step keeps SDPA
        assert calls == []
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, expected_last, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv[:, :, :, :90], kv_cold[:, :, :, :90], rtol=1e-5, atol=1e-5)


def test_sdpa_where_flash_cannot_run_and_an_error_where_it_was_asked_for():
    cpu = select_attention("auto", torch.device("cpu"), torch.float32, 64)
    assert (cpu.name, cpu.prefill) == ("sdpa", None) and "CUDA only" in cpu.reason
    assert "bf16 or fp16" in select_attention("auto", CUDA, torch.float32, 64).reason
    assert "head dims" in select_attention("auto", CUDA, torch.bfloat16, 72 * 4).reason
    assert select_attention("sdpa", CUDA, torch.bfloat16, 128).prefill is None
    with pytest.raises(AttentionUnavailable, match="runs on CUDA only"):
        select_attention("flash", torch.device("cpu"), torch.float32, 64)
    with pytest.raises(ValueError, match="attention must be one of"):
        select_attention("fast", CUDA, torch.bfloat16, 128)


def test_the_deterministic_mode_takes_flash_where_its_library_names_its_version(monkeypatch):
    """The grid runs FlashAttention where the library's version can be told (fails on the code that kept the
    deterministic mode on SDPA: sdpa was chosen, and ``flash`` refused); one of unknown version is not used there,
    since the mode's namespace names it."""
    known = FlashKernel("stand-in", reference_varlen, build="stand-in 1.0")
    monkeypatch.setattr(flash, "KERNEL_LOADERS", (("stand_in", lambda: known),))
    for choice in ("auto", "flash"):
        chosen = select_attention(choice, CUDA, torch.bfloat16, 128, deterministic=True)
        assert chosen.name == "stand-in" and chosen.prefill.kernel is known
    unknown = FlashKernel("stand-in", reference_varlen)
    monkeypatch.setattr(flash, "KERNEL_LOADERS", (("stand_in", lambda: unknown),))
    chosen = select_attention("auto", CUDA, torch.bfloat16, 128, deterministic=True)
    assert chosen.prefill is None and "version cannot be told" in chosen.reason
    with pytest.raises(AttentionUnavailable, match="version cannot be told"):
        select_attention("flash", CUDA, torch.bfloat16, 128, deterministic=True)
    assert select_attention("auto", CUDA, torch.bfloat16, 128).prefill.kernel is unknown  # the fast mode takes it
    assert select_attention("sdpa", CUDA, torch.bfloat16, 128, deterministic=True).prefill is None


def test_the_libraries_builds_name_their_versions():
    import types
    from importlib.metadata import version

    module = types.SimpleNamespace(__version__="2.7.1")
    assert flash._library_build("no-such-distribution-here", module) == "no-such-distribution-here 2.7.1"
    assert flash._library_build("no-such-distribution-here", None) == ""
    assert flash._library_build("torch", None) == f"torch {version('torch')}"  # the installed distribution's


def test_one_cu_seqlens_pair_per_shape_across_layers_and_grid_chunks():
    """A tensor made from a list is a synchronous copy on a GPU: each (queries, keys) pair is made once, however
    many layers ask (fails when only the last pair is kept: the grid's chunks alternate shapes)."""
    prefill = stand_in()
    made = [prefill._cu_seqlens(32, 32 * (j + 1), torch.device("cpu")) for j in range(3)]
    again = [prefill._cu_seqlens(32, 32 * (j + 1), torch.device("cpu")) for j in range(3)]
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(made, again))
    assert made[2][1].tolist() == [0, 96]


@pytest.fixture
def broken_flash_libraries(tmp_path, monkeypatch):
    """No vLLM kernels, and a flash_attn package that raises on import (a build for another CUDA)."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('undefined symbol: a build for another CUDA')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", None)  # None in sys.modules: the import fails
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)


def test_absent_or_broken_libraries_fall_back_to_sdpa(broken_flash_libraries):
    """Fails when find_flash_kernel catches only ImportError: a build for another CUDA raises RuntimeError."""
    kernel, reasons = flash.find_flash_kernel()
    assert kernel is None
    assert reasons[0].startswith("vllm.vllm_flash_attn: ModuleNotFoundError")
    assert reasons[1] == "flash_attn: RuntimeError: undefined symbol: a build for another CUDA"
    chosen = select_attention("auto", CUDA, torch.bfloat16, 128)
    assert chosen.prefill is None and "no FlashAttention library loads" in chosen.reason
    with pytest.raises(AttentionUnavailable, match="--attention flash: no FlashAttention library loads"):
        select_attention("flash", CUDA, torch.bfloat16, 128)


def test_the_first_library_that_loads_is_chosen(monkeypatch):
    def absent() -> FlashKernel:
        raise ImportError("No module named 'vllm'")

    fake = FlashKernel("flash_attn", reference_varlen)
    monkeypatch.setattr(flash, "KERNEL_LOADERS", (("vllm.vllm_flash_attn", absent), ("flash_attn", lambda: fake)))
    chosen = select_attention("auto", CUDA, torch.float16, 128)
    assert chosen.name == "flash_attn" and chosen.prefill.kernel is fake


def test_an_engine_refuses_flash_attention_where_it_cannot_run():
    from kvshare.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny"))  # auto on CPU: SDPA
    assert engine.attention.name == "sdpa" and engine.model.prefill_attention is None
    engine.close()
    with pytest.raises(AttentionUnavailable, match="--attention flash"):
        Engine(EngineConfig(model="tiny", attention="flash"))
    with pytest.raises(ValueError, match="attention must be one of"):
        EngineConfig(model="tiny", attention="fa3")


def test_serve_attention_reaches_the_engine_config():
    """Fails when serve's --attention is parsed but not handed to EngineConfig."""
    import argparse

    from kvshare.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.engine_config(parser.parse_args([])).attention == "auto"
    assert serve.engine_config(parser.parse_args(["--attention", "sdpa"])).attention == "sdpa"
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention", "fa3"])
