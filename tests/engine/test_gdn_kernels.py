"""The choice of the Gated DeltaNet's kernels (kvshare.engine.gdn_kernels): the torch reference on CPU, when asked
for, and when flash-linear-attention cannot load; its self-test refuses kernels that compute something else."""

from __future__ import annotations

import logging

import pytest
import torch

from kvshare.engine.gdn import TorchGDN
from kvshare.engine.gdn_kernels import CHOICE_ENV, choose_gdn_kernels, linear_build, self_test, use_gdn_kernels
from kvshare.engine.presets import build_preset

SHAPES = {"key_heads": 2, "value_heads": 6, "head_dim": 16}


def test_the_torch_reference_on_cpu_and_where_asked_for(monkeypatch):
    assert choose_gdn_kernels(torch.device("cpu"), torch.float32, SHAPES).reason == "not a CUDA device"
    monkeypatch.setenv(CHOICE_ENV, "torch")
    chosen = choose_gdn_kernels(torch.device("cuda"), torch.bfloat16, SHAPES)
    assert chosen.kernels.name == "torch" and chosen.reason == f"{CHOICE_ENV}=torch"


def test_a_library_that_does_not_load_leaves_the_reference_with_a_warning(monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_fla(name, *args, **kwargs):
        if name == "fla" or name.startswith("fla."):
            raise ImportError("No module named 'fla'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fla)
    with caplog.at_level(logging.WARNING, logger="kvshare.engine.gdn_kernels"):
        chosen = choose_gdn_kernels(torch.device("cuda"), torch.bfloat16, SHAPES)
    assert chosen.kernels.name == "torch" and "ImportError" in chosen.reason
    assert "install fla-core" in caplog.text


def test_the_self_test_passes_the_reference_and_refuses_a_kernel_that_differs():
    self_test(TorchGDN(), torch.device("cpu"), torch.float32, **SHAPES)

    class Wrong(TorchGDN):
        def step(self, q, k, v, g, beta, state):
            out = super().step(q, k, v, g, beta, state)
            state.mul_(1.1)  # a final state off by 10%
            return out

    with pytest.raises(AssertionError, match="step: final state"):
        self_test(Wrong(), torch.device("cpu"), torch.float32, **SHAPES)


def test_the_choice_is_set_on_every_gdn_layer_and_named_in_the_kernel_build():
    model, config, _ = build_preset("qwen3.5-tiny", torch.device("cpu"))
    chosen = use_gdn_kernels(model, torch.device("cpu"))
    layers = [layer for layer in model.model.layers if not layer.is_attention]
    assert len(layers) == config.num_linear_layers and all(
        layer.linear_attn.kernels is chosen.kernels for layer in layers
    )
    assert linear_build(model) == "|gdn torch"
    tiny, _, _ = build_preset("tiny", torch.device("cpu"))
    assert linear_build(tiny) == ""  # an attention model's kernel build is what it was
