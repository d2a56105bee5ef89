"""The fused element-wise kernels' choice and wiring (kvshare.engine.fused), on CPU: where they are refused, that
a failing self-test refuses them, and that every RMSNorm, RoPE and SiLU x up of the model runs what was chosen.
The Triton kernels themselves run on CUDA only: tests/engine/test_fused_gpu.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvshare.engine.config import EngineConfig
from kvshare.engine.fused import OFF_ENV, choose_fused, self_test, set_fused
from kvshare.engine.model import apply_rope, rms_norm


class EagerKernels:
    """The eager code behind the fused kernels' signatures, counting its calls."""

    name = "eager-spy"
    version = "spy 1.0"

    def __init__(self) -> None:
        self.calls = {"rms_norm": 0, "rope": 0, "silu_mul": 0}

    def rms_norm(self, x, weight, eps):
        self.calls["rms_norm"] += 1
        return rms_norm(x, weight, eps)

    def rope(self, x, cos, sin):
        self.calls["rope"] += 1
        return apply_rope(x, cos, sin)

    def silu_mul(self, gate, up):
        self.calls["silu_mul"] += 1
        return F.silu(gate) * up


class BatchDependentNorm(EagerKernels):
    """Right within tolerance, but a row's result depends on how many rows share the call."""

    def rms_norm(self, x, weight, eps):
        out = rms_norm(x, weight, eps)
        return out + out.new_full((), 1e-3 * (x.reshape(-1, x.shape[-1]).shape[0] % 7))


class WrongRope(EagerKernels):
    def rope(self, x, cos, sin):
        return apply_rope(x, sin, cos)


def test_refused_on_cpu_in_float32_and_when_turned_off(monkeypatch):
    cuda = torch.device("cuda")
    assert choose_fused(torch.device("cpu"), torch.bfloat16, 128).kernels is None
    assert choose_fused(cuda, torch.float32, 128).kernels is None
    assert choose_fused(cuda, torch.bfloat16, 96).kernels is None  # RoPE's halves need a power of two
    monkeypatch.setenv(OFF_ENV, "0")
    assert choose_fused(cuda, torch.bfloat16, 128).reason == f"{OFF_ENV}=0"


def test_a_kernel_that_cannot_be_built_leaves_the_eager_code(monkeypatch):
    """Without Triton (as on this CPU machine) or with a kernel that fails to compile, the engine runs eagerly."""

    def no_triton():
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr("kvshare.engine.fused._build", no_triton)
    chosen = choose_fused(torch.device("cuda"), torch.bfloat16, 128)
    assert chosen.kernels is None and "triton" in chosen.reason


def test_the_self_test_passes_the_eager_code_and_catches_wrong_or_batch_dependent_kernels():
    """Fails when the self-test compares nothing: a swapped cos/sin and a batch-dependent norm both pass then."""
    cpu = torch.device("cpu")
    self_test(EagerKernels(), cpu, torch.bfloat16, 128)
    for bad, what in ((WrongRope(), "rope"), (BatchDependentNorm(), "rms_norm")):
        try:
            self_test(bad, cpu, torch.bfloat16, 128)
        except AssertionError as exc:
            assert what in str(exc)
        else:
            raise AssertionError(f"the self-test passed a wrong {what}")


def test_every_norm_rope_and_mlp_of_the_model_runs_the_chosen_kernels():
    """Fails when RMSNorm, attention's RoPE or the MLP ignores the kernels set on it (a call count of 0)."""
    from kvshare.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny", device="cpu", local_cache_bytes=0, max_model_len=512))
    assert engine.fused.kernels is None and engine.fused.reason == "not a CUDA device"
    c = engine.model_config
    ids = torch.arange(5, 45)
    kv = torch.zeros(c.num_layers, 2, c.num_kv_heads, 64, c.head_dim, dtype=engine.model.lm_head.weight.dtype)
    with torch.inference_mode():
        eager = engine.model(ids, kv.clone(), 0, all_logits=True)
        spy = EagerKernels()
        set_fused(engine.model, spy)
        try:
            fused = engine.model(ids, kv.clone(), 0, all_logits=True)
        finally:
            set_fused(engine.model, None)
    norms = 2 * c.num_layers + 1 + (2 * c.num_layers if c.qk_norm else 0)
    assert spy.calls == {"rms_norm": norms, "rope": 2 * c.num_layers, "silu_mul": c.num_layers}
    assert torch.equal(fused, eager)


def test_the_deterministic_modes_kernel_build_names_the_elementwise_kernels():
    """Pages of the deterministic mode computed with the fused kernels never meet pages of the eager code: the
    kernel build in its namespace names them (fails when start_grid leaves elementwise_build out)."""
    from kvshare.engine.engine import Engine
    from kvshare.engine.grid_check import start_grid

    engine = Engine(EngineConfig(model="tiny", device="cpu", local_cache_bytes=0, max_model_len=512))
    eager = start_grid(engine.model, engine.device, 256, 128).kernel_build
    set_fused(engine.model, EagerKernels())
    try:
        fused = start_grid(engine.model, engine.device, 256, 128).kernel_build  # its self-test passes with them
    finally:
        set_fused(engine.model, None)
    assert "elementwise" not in eager and fused == eager + "|elementwise eager-spy spy 1.0"
