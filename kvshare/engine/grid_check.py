"""The deterministic mode's self-test, run when an engine starts in it: are the grid's kernels exact here?

The grid (kvshare.engine.grid) is exact by construction only if each of its calls, on the
same input bits and shapes, gives the same output bits wherever its tensors live: in the
cold run's KV buffer or in another replica's (another capacity, so other strides; other
addresses; other garbage past the positions read). This checks that on the engine's own
device, dtype and model shapes, two ways each, bitwise:

    attention   grid chunk j's queries over keys [0, e): in a buffer of one capacity, and in a
                buffer of another where chunks < j were copied in (as a load does) and every
                other position holds NaN
    matmuls     every projection of layer 0 and the LM head on G rows (a zero-padded tail too):
                in fresh tensors, and as views into larger buffers at an offset
    end to end  the model: a cold grid prefill of 2G + G/2 + 1 tokens, and the same prompt over
                its first grid chunk copied into another buffer; KV of every token, the last
                logits and one decode step after it

A failure refuses the mode (GridCheckFailed) naming what differed. Nothing here is cached:
the check costs a few grid chunks of compute at start-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from kvshare.engine.flash import attention_build
from kvshare.engine.fused import elementwise_build
from kvshare.engine.gdn_kernels import linear_build
from kvshare.engine.grid import Grid, grid_attention, grid_backends, grid_forward, kernel_build, pad_rows
from kvshare.engine.model import Transformer
from kvshare.errors import UserError

SEED = 20261201
log = logging.getLogger(__name__)


class GridCheckFailed(UserError):
    """The deterministic mode's kernels are not exact on this device; the mode is refused."""


@dataclass(frozen=True)
class CheckResult:
    name: str
    is_exact: bool
    detail: str = ""  # where the two ways differed


Check = Callable[[Transformer, torch.device, int], list[CheckResult]]  # a model's self-test: every check's result


def start_grid(
    model: Transformer, device: torch.device, grid_tokens: int, chunk_tokens: int, check: Check | None = None
) -> Grid:
    """The deterministic mode of an engine starting: its Grid, once the self-test (``check``: check_grid, or a hybrid
    model's kvshare.engine.hybrid_grid_check) found this device exact.

    A FlashAttention kernel (the model's prefill attention) that is not exact here leaves the grid on SDPA, with a
    warning: the mode is refused only where SDPA is not exact either."""
    Grid(grid_tokens, chunk_tokens, "")  # the sizes checked before any compute
    check = check or check_grid
    started = time.perf_counter()
    try:
        require_exact_grid(model, device, grid_tokens, check)
    except GridCheckFailed as exc:
        if model.prefill_attention is None:
            raise
        log.warning(
            "deterministic mode: the grid runs SDPA: with %s prefill attention, %s", attention_build(model), exc
        )
        model.prefill_attention = None
        require_exact_grid(model, device, grid_tokens, check)
    # what the pages' bits rest on: the device's kernels, the element-wise kernels (kvshare.engine.fused), the
    # prefill attention (kvshare.engine.flash) and a hybrid's Gated DeltaNet kernels the model runs
    build = kernel_build(device) + elementwise_build(model) + attention_build(model) + linear_build(model)
    grid = Grid(grid_tokens, chunk_tokens, build)
    log.info(
        "deterministic mode: grid of %d tokens, kernels exact here (self-test %.1f s); kernel build %s",
        grid_tokens,
        time.perf_counter() - started,
        grid.kernel_build,
    )
    return grid


def check_grid(model: Transformer, device: torch.device, grid_tokens: int) -> list[CheckResult]:
    """Every check's result (none raises); ``require_exact_grid`` turns a failure into an error."""
    generator = torch.Generator(device="cpu").manual_seed(SEED)
    with torch.inference_mode():
        return [
            check_attention(model, device, grid_tokens, generator),
            _check_matmuls(model, device, grid_tokens, generator),
            _check_end_to_end(model, device, grid_tokens, generator),
        ]


def require_exact_grid(
    model: Transformer, device: torch.device, grid_tokens: int, check: Check | None = None
) -> list[CheckResult]:
    """Run the self-test (``check``, check_grid by default); raise GridCheckFailed naming every check not exact."""
    results = (check or check_grid)(model, device, grid_tokens)
    failed = [r for r in results if not r.is_exact]
    if failed:
        what = "; ".join(f"{r.name}: {r.detail}" for r in failed)
        raise GridCheckFailed(
            f"the deterministic mode is refused on {device} ({model.model.embed_tokens.weight.dtype}, grid "
            f"{grid_tokens} tokens): computed two ways, {what}. Its exactness needs kernels that give the same bits "
            "for the same inputs wherever they live; serve without --deterministic, or try another --dtype or "
            "--grid-tokens"
        )
    return results


def _random(shape, dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)


def garbage(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A buffer whose every position not written yet holds NaN: a kernel that read past its keys would show."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def differs(a: Tensor, b: Tensor) -> str:
    """'' when a and b hold the same bits; else how much and where they differ."""
    if a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
        return ""
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    diff = (a.float() - b.float()).abs()
    return f"{int((a != b).sum())} of {a.numel()} values differ, by up to {float(diff.max()):.3g}"


def check_attention(model, device, grid: int, generator) -> CheckResult:
    """Grid chunk j's queries over keys [0, e) in two buffers of other capacities (the other filled with NaN)."""
    c = model.config
    dtype = model.model.embed_tokens.weight.dtype
    num_chunks = 3
    n = num_chunks * grid
    q = _random((c.num_heads, n, c.head_dim), dtype, device, generator)  # [Hq, n, D]
    kv = _random((2, c.num_kv_heads, n, c.head_dim), dtype, device, generator)  # [2, H, n, D]
    first = torch.empty(2, c.num_kv_heads, n + grid, c.head_dim, dtype=dtype, device=device)  # capacity n + G
    second = garbage((2, c.num_kv_heads, n + 3 * grid, c.head_dim), dtype, device)  # capacity n + 3G
    first[:, :, :n] = kv
    attention = grid_attention(model)
    with sdpa_kernel(grid_backends(device), set_priority=True):
        for j in range(num_chunks):
            s, e = j * grid, (j + 1) * grid
            second[:, :, s:e] = kv[:, :, s:e]  # chunks < j were "loaded" into it before
            a = attention(q[:, s:e], first[0, :, :e], first[1, :, :e], s)
            b = attention(q[:, s:e].clone(), second[0, :, :e], second[1, :, :e], s)
            if differs(a, b):
                return CheckResult("attention", False, f"grid chunk {j}: {differs(a, b)}")
    return CheckResult("attention", True)


def _check_matmuls(model: Transformer, device, grid: int, generator) -> CheckResult:
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    linears = {
        "q_proj": attn.q_proj,
        "k_proj": attn.k_proj,
        "v_proj": attn.v_proj,
        "o_proj": attn.o_proj,
        "gate_proj": mlp.gate_proj,
        "up_proj": mlp.up_proj,
        "down_proj": mlp.down_proj,
    }
    dtype = model.model.embed_tokens.weight.dtype
    for name, linear in linears.items():
        rows = _random((grid // 2 + 1, linear.in_features), dtype, device, generator)  # a tail of a grid chunk
        x = pad_rows(rows, grid)  # [G, in]
        a = linear(x)
        big = torch.zeros(3 * grid, linear.in_features, dtype=dtype, device=device)  # another buffer, at an offset
        big[grid + 1 : 2 * grid + 1] = x
        b = linear(big[grid + 1 : 2 * grid + 1])
        if differs(a, b):
            return CheckResult("matmuls", False, f"{name} on {grid} rows: {differs(a, b)}")
    h = _random((1, model.config.hidden_size), dtype, device, generator)
    a = torch.empty(1, model.config.vocab_size, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    model.logits(h, a)
    model.logits(h.clone(), b)
    if differs(a, b):
        return CheckResult("matmuls", False, f"lm_head: {differs(a, b)}")
    return CheckResult("matmuls", True)


def _check_end_to_end(model: Transformer, device, grid: int, generator) -> CheckResult:
    c = model.config
    dtype = model.model.embed_tokens.weight.dtype
    n = 2 * grid + grid // 2 + 1  # two full grid chunks and a tail
    ids = torch.randint(0, c.vocab_size, (n,), generator=generator).to(device)
    cold_kv = torch.empty(c.num_layers, 2, c.num_kv_heads, n + 1, c.head_dim, dtype=dtype, device=device)
    warm_kv = garbage((c.num_layers, 2, c.num_kv_heads, n + grid + 7, c.head_dim), dtype, device)
    cold = grid_forward(model, ids, cold_kv, 0, grid)
    warm_kv[:, :, :, :grid] = cold_kv[:, :, :, :grid]  # the first grid chunk "loaded"
    warm = grid_forward(model, ids[grid:], warm_kv, grid, grid)
    kv_diff = differs(cold_kv[:, :, :, :n], warm_kv[:, :, :, :n])
    if kv_diff:
        return CheckResult("end to end", False, f"KV after a reused grid chunk: {kv_diff}")
    if differs(cold, warm):
        return CheckResult("end to end", False, f"last-token logits: {differs(cold, warm)}")
    step = cold.argmax(dim=-1)  # [1]
    a, b = model(step, cold_kv, n), model(step.clone(), warm_kv, n)
    if differs(a, b):
        return CheckResult("end to end", False, f"a decode step: {differs(a, b)}")
    return CheckResult("end to end", True)
