"""Fused CUDA kernels (Triton) for the element-wise work between the matmuls: RMSNorm, RoPE, SiLU x up.

In eager torch an RMSNorm over a bf16 [T, E] activation is about ten passes over memory (the float32
upcast, the square, the mean, the scale, the cast back, the weight), RoPE five and SiLU x up three; at
32k tokens of the 8B shape that is ~0.3 s of a prefill spent moving activations, where one pass each
suffices. These kernels make one pass and keep the eager arithmetic: the same float32 upcasts, the same
roundings to the model's dtype in the same places (RMSNorm casts before the weight, as the Hugging Face
reference does; RoPE rounds each product and their sum as torch's bf16 operators do). On an H100 RMSNorm and
SiLU x up gave the eager results bit for bit on random inputs; RoPE differed by one bf16 step in about a
quarter of the elements (the compiler's float32 arithmetic is not torch's), as close to float32 as the eager
result. Each row is computed by one program whose shape depends on the row's length only, never on the
number of rows, so a token's result does not depend on how many tokens share its call.

The built-in engine uses them on CUDA where Triton imports and their start-up self-test (against the eager
code on this device) passes. The deterministic mode runs them too: they are deterministic (no atomics, a
fixed reduction per row), its own start-up self-test checks the model with them, and its kernel build names
them, so its pages never meet pages of the eager code. ``KVSHARE_FUSED_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)
OFF_ENV = "KVSHARE_FUSED_KERNELS"
_ELEMENTS_PER_PROGRAM = 4096


@dataclass(frozen=True)
class FusedChoice:
    """What an engine's element-wise work runs: ``kernels`` None means eager torch."""

    kernels: Any  # TritonKernels, or None
    reason: str


class TritonKernels:
    """The three fused operations, each with the eager operation's signature and result dtype."""

    name = "triton"

    def __init__(self) -> None:
        self._jit = _build()
        self.version = self._jit.VERSION  # the compiler's: another version may compile other arithmetic

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        dim = x.shape[-1]
        rows = x.reshape(-1, dim)  # a view for the engine's contiguous activations
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        if rows.shape[0] == 0:
            return out.view(x.shape)
        block = _next_pow2(dim)
        block_rows = max(2, _ELEMENTS_PER_PROGRAM // block)  # fixed by the row's length: rows never share math
        grid = (_cdiv(rows.shape[0], block_rows),)
        with _on(x.device):
            self._jit.rms_norm[grid](
                rows,
                weight,
                out,
                rows.stride(0),
                rows.shape[0],
                dim,
                eps,
                BLOCK=block,
                BLOCK_ROWS=block_rows,
                num_warps=8,
            )
        return out.view(x.shape)

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: [T, heads, D] (D a power of two); cos, sin: [T, D] -> [T, heads, D]."""
        num_tokens, heads, dim = x.shape
        if x.stride(-1) != 1 or x.stride(1) != dim:
            x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        with _on(x.device):
            self._jit.rope[(num_tokens,)](
                x, cos, sin, out, x.stride(0), heads, dim // 2, BLOCK_H=_next_pow2(heads), D=dim, num_warps=4
            )
        return out

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        n = gate.numel()
        with _on(gate.device):
            self._jit.silu_mul[(_cdiv(n, _ELEMENTS_PER_PROGRAM),)](
                gate, up, out, n, BLOCK=_ELEMENTS_PER_PROGRAM, num_warps=8
            )
        return out


def choose_fused(device: torch.device, dtype: torch.dtype, head_dim: int, hidden_size: int = 4096) -> FusedChoice:
    """Triton's kernels where they can run here and pass the self-test; else eager, with the reason."""
    if os.environ.get(OFF_ENV, "1").strip() in ("0", "off", "false", "no"):
        return FusedChoice(None, f"{OFF_ENV}=0")
    if device.type != "cuda":
        return FusedChoice(None, "not a CUDA device")
    if dtype not in (torch.bfloat16, torch.float16):
        return FusedChoice(None, f"{dtype} (the kernels are for bf16 and fp16)")
    if head_dim & (head_dim - 1):
        return FusedChoice(None, f"head_dim {head_dim} is not a power of two")
    try:
        kernels = TritonKernels()
        self_test(kernels, device, dtype, head_dim, hidden_size)
    except Exception as exc:  # no Triton, a compile error, a wrong result: the eager kernels are always right
        log.warning("fused kernels off: %s: %s", type(exc).__name__, exc)
        return FusedChoice(None, f"{type(exc).__name__}: {exc}"[:200])
    return FusedChoice(kernels, "self-test passed")


def self_test(kernels, device: torch.device, dtype: torch.dtype, head_dim: int, hidden_size: int = 4096) -> None:
    """Each kernel against the eager code on small random inputs of the model's row lengths; rows computed alone
    equal rows computed in a batch, bit for bit. Raises AssertionError naming the first that differs."""
    from kvshare.engine.model import apply_rope, rms_norm

    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    for rows, dim in ((37, hidden_size), (300, head_dim)):
        x, w = rand(rows, dim, scale=3.0), rand(dim)
        got = kernels.rms_norm(x, w, 1e-6)
        torch.testing.assert_close(got, rms_norm(x, w, 1e-6), rtol=1.6e-2, atol=1e-2, msg="rms_norm")
        assert torch.equal(kernels.rms_norm(x[:5], w, 1e-6), got[:5]), "rms_norm: a row depends on its batch"
    x, angles = rand(19, 5, head_dim), torch.rand(19, head_dim, generator=g) * 6.3
    cos, sin = angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)
    torch.testing.assert_close(kernels.rope(x, cos, sin), apply_rope(x, cos, sin), rtol=1.6e-2, atol=1e-2, msg="rope")
    gate, up = rand(7, 1000, scale=4.0), rand(7, 1000)
    torch.testing.assert_close(kernels.silu_mul(gate, up), F.silu(gate) * up, rtol=1.6e-2, atol=1e-2)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a fault in a kernel surfaces here, inside the test


def _on(device: torch.device):
    """Triton launches on the current CUDA device, not the tensors': make it theirs where it is not (a replica on
    cuda:1 that never set its device)."""
    if device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _build():
    """The jitted kernels (imports Triton: only on a CUDA engine that uses them)."""
    from kvshare.engine import fused_triton

    return fused_triton


def use_fused(model, device: torch.device) -> FusedChoice:
    """``choose_fused`` for ``model`` (a kvshare.engine.model.Transformer), set on its modules. A hybrid (Qwen3.5)
    runs the eager code: its norms scale by (1 + weight) and its RoPE turns part of each head, as no kernel does."""
    if model.config.is_hybrid:
        return FusedChoice(None, "a hybrid model's norms and partial RoPE have no fused kernel")
    weight = model.model.embed_tokens.weight
    chosen = choose_fused(device, weight.dtype, model.config.head_dim, model.config.hidden_size)
    set_fused(model, chosen.kernels)
    return chosen


def elementwise_build(model) -> str:
    """What the deterministic mode's kernel build adds for ``model``'s element-wise kernels: nothing for the eager
    code, else the kernels and their compiler's version (pages of one are not the bits of the other)."""
    kernels = model.model.norm.fused
    if kernels is None:
        return ""
    return f"|elementwise {kernels.name} {getattr(kernels, 'version', '')}".rstrip()


def set_fused(model, kernels) -> None:
    """Every RMSNorm, attention (RoPE) and MLP of ``model`` runs ``kernels`` (None: the eager code)."""
    from kvshare.engine.model import MLP, Attention, RMSNorm

    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention, MLP)):
            module.fused = kernels
