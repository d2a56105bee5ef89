"""FlashAttention varlen for the built-in engine's prefill: which kernel library, if any, and the call.

``--attention auto`` (the default) uses ``flash_attn_varlen_func`` where the engine runs on CUDA in bf16/fp16 and
one of these imports: vLLM's bundled ``vllm.vllm_flash_attn`` (FA3 where ``is_fa_version_supported(3)``, else
FA2) or the ``flash_attn`` package (FA2); otherwise it keeps SDPA (kvshare.engine.model.attend). A library that
is absent or raises on import is a fall back to SDPA for ``auto`` and a clear error for ``flash``.

Only a prefill of more than one query goes through it; a decode step keeps SDPA's flash backend. Its causal mask
is aligned to the lower right (FlashAttention's convention when seqlen_q != seqlen_k), as a suffix over a reused
prefix needs. vLLM's kernels get ``num_splits=1``: the key/value sequence is never split across thread blocks, so
a row's result does not depend on how many others share the GPU. The deterministic mode runs the same kernel
once per grid chunk (kvshare.engine.grid), where only determinism is asked of it (the same call on the same bits
gives the same bits), which its start-up self-test checks on the device; a kernel that fails it leaves the grid on
SDPA. Its namespace's kernel build names the kernel and its library's version (``attention_build``), and a
library whose version cannot be told is not used there.

Pages written by a replica on FlashAttention and one on SDPA differ only by rounding, as pages of two prefill
chunkings do; the fast mode shares them (the outputs rule of kvshare.outputs applies).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvshare.engine.config import ATTENTION_CHOICES

FLASH_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256  # FlashAttention 2 and 3 take head dims up to 256, multiples of 8
MAX_SEQLENS = 4096  # cu_seqlens pairs kept (a 1M-token prompt on a grid of 256 has 4096 grid chunks)


class AttentionUnavailable(ValueError):
    """``--attention flash`` where no FlashAttention kernel can run."""


@dataclass(frozen=True)
class FlashKernel:
    """One library's ``flash_attn_varlen_func`` and the keyword arguments it takes beyond the common ones."""

    name: str  # e.g. "vllm_flash_attn FA3", "flash_attn"
    varlen: Callable[..., Tensor]
    extra: dict = field(default_factory=dict)
    build: str = ""  # the library and its version ("vllm 0.26.0"); "" where it cannot be told


def _library_build(distribution: str, module) -> str:
    """``distribution``'s installed version, else the module's ``__version__``; "" where neither says."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{distribution} {version(distribution)}"
    except (PackageNotFoundError, ValueError):
        found = getattr(module, "__version__", "")
        return f"{distribution} {found}" if found else ""


def _vllm_kernel() -> FlashKernel:
    mod = importlib.import_module("vllm.vllm_flash_attn")
    for version in (3, 2):
        if mod.is_fa_version_supported(version):
            return FlashKernel(
                f"vllm_flash_attn FA{version}",
                mod.flash_attn_varlen_func,
                {"fa_version": version, "num_splits": 1},
                _library_build("vllm", sys.modules.get("vllm")),  # the submodule's import imported its package
            )
    raise ImportError(f"vllm_flash_attn supports neither FA3 nor FA2 here: {mod.fa_version_unsupported_reason(2)}")


def _flash_attn_kernel() -> FlashKernel:
    mod = importlib.import_module("flash_attn")
    return FlashKernel("flash_attn", mod.flash_attn_varlen_func, build=_library_build("flash-attn", mod))


# tried in this order; each raises when its library is absent or cannot run here
KERNEL_LOADERS: tuple[tuple[str, Callable[[], FlashKernel]], ...] = (
    ("vllm.vllm_flash_attn", _vllm_kernel),
    ("flash_attn", _flash_attn_kernel),
)


def find_flash_kernel() -> tuple[FlashKernel | None, list[str]]:
    """The first kernel library that imports and can run, and why each one before it could not."""
    reasons = []
    for module, load in KERNEL_LOADERS:
        try:
            return load(), reasons
        except Exception as exc:  # a broken install raises anything on import: each is a reason to fall back
            reasons.append(f"{module}: {type(exc).__name__}: {exc}".splitlines()[0])
    return None, reasons


def flash_unfit(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashAttention cannot run this model here, or None."""
    if device.type != "cuda":
        return f"it runs on CUDA only (the engine runs on {device.type})"
    if dtype not in FLASH_DTYPES:
        return f"it takes bf16 or fp16 (the model runs in {str(dtype).removeprefix('torch.')})"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"it takes head dims up to {MAX_HEAD_DIM}, multiples of 8 (the model's is {head_dim})"
    return None


@dataclass(frozen=True)
class AttentionChoice:
    """What prefill attention an engine runs: ``prefill`` None means SDPA (kvshare.engine.model.attend)."""

    name: str  # "sdpa" or the kernel's name
    prefill: Callable[[Tensor, Tensor, Tensor, int], Tensor] | None
    reason: str  # why this one


def select_attention(
    choice: str, device: torch.device, dtype: torch.dtype, head_dim: int, deterministic: bool = False
) -> AttentionChoice:
    """The prefill attention for ``--attention choice``; ``flash`` where none can run raises AttentionUnavailable."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {choice!r}")
    if choice == "sdpa":
        return AttentionChoice("sdpa", None, "asked for")
    unfit = flash_unfit(device, dtype, head_dim)
    kernel, reasons = (None, []) if unfit else find_flash_kernel()
    if kernel is not None and deterministic and not kernel.build:
        unfit, kernel = f"{kernel.name}'s version cannot be told, and the deterministic mode's namespace names it", None
    if kernel is None:
        why = unfit or "no FlashAttention library loads: " + "; ".join(reasons)
        if choice == "flash":
            raise AttentionUnavailable(f"--attention flash: {why}; use --attention auto or sdpa")
        return AttentionChoice("sdpa", None, why)
    return AttentionChoice(kernel.name, FlashPrefill(kernel), "found")


def attention_build(model) -> str:
    """What the deterministic mode's kernel build adds for ``model``'s prefill attention: nothing for SDPA (part of
    torch, which the build names), else the kernel and its library's version."""
    prefill = model.prefill_attention
    if not isinstance(prefill, FlashPrefill):
        return ""
    return f"|attention {prefill.kernel.name} {prefill.kernel.build}"


def use_attention(model, choice: str, device: torch.device, deterministic: bool = False) -> AttentionChoice:
    """``select_attention`` for ``model`` (a kvshare.engine.model.Transformer), set as its prefill's attention."""
    weight = model.model.embed_tokens.weight
    chosen = select_attention(choice, device, weight.dtype, model.config.head_dim, deterministic)
    model.prefill_attention = chosen.prefill
    return chosen


class FlashPrefill:
    """``attend`` (kvshare.engine.model) for a prefill through one kernel's ``flash_attn_varlen_func``."""

    def __init__(self, kernel: FlashKernel) -> None:
        self.kernel = kernel
        # cu_seqlens per (queries, keys, device): every layer of a forward, and every layer's grid chunk j in the
        # deterministic mode, reuses its pair; a tensor made from a list is a synchronous copy to the GPU
        self._seqlens: dict[tuple, tuple[Tensor, Tensor]] = {}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """q: [Hq, T, D] for positions [start, start+T); k, v: [H, start+T, D] -> [Hq, T, D].

        The varlen layout is token-major, [tokens, heads, D]: transposed views of the engine's head-major KV
        and q (the last dim stays contiguous, which is all the kernels ask; no copy). One sequence:
        cu_seqlens = [0, T] and [0, start+T]; causal aligned to the lower right."""
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)  # a float8 cache: attention computes in the model's dtype
        num_queries, num_keys = q.shape[1], k.shape[1]
        cu_q, cu_k = self._cu_seqlens(num_queries, num_keys, q.device)
        out = self.kernel.varlen(
            q=q.transpose(0, 1),
            k=k.transpose(0, 1),
            v=v.transpose(0, 1),
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=num_queries,
            max_seqlen_k=num_keys,
            causal=True,
            **self.kernel.extra,
        )  # [T, Hq, D]
        return out.transpose(0, 1)

    def _cu_seqlens(self, num_queries: int, num_keys: int, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (num_queries, num_keys, device)
        found = self._seqlens.get(key)
        if found is None:
            if len(self._seqlens) >= MAX_SEQLENS:
                self._seqlens.clear()
            found = self._seqlens[key] = (
                torch.tensor([0, num_queries], dtype=torch.int32, device=device),
                torch.tensor([0, num_keys], dtype=torch.int32, device=device),
            )
        return found
