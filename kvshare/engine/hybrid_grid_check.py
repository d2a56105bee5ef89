"""The deterministic mode's self-test for a hybrid model: are its grid's kernels exact on this device?

As kvshare.engine.grid_check for the attention models (its attention check is run as is), with the end-to-end
check over the hybrid's own state: a cold grid prefill of 2G + G/2 + 1 tokens that keeps a checkpoint at the
first grid boundary, and the same prompt resumed from that checkpoint with the first grid chunk's KV copied into
another buffer (every other position NaN). Its KV, GDN state, last logits and one decode step after it must equal
the cold run's bit for bit. The check leaves the model's GDN state reset.
"""

from __future__ import annotations

import torch

from kvshare.engine.grid_check import SEED, CheckResult, check_attention, differs, garbage
from kvshare.engine.hybrid_grid import hybrid_grid_forward


def check_hybrid_grid(model, device: torch.device, grid_tokens: int) -> list[CheckResult]:
    """Every check's result (none raises); grid_check.require_exact_grid turns a failure into an error."""
    generator = torch.Generator(device="cpu").manual_seed(SEED)
    try:
        with torch.inference_mode():
            return [
                check_attention(model, device, grid_tokens, generator),
                _check_end_to_end(model, device, grid_tokens, generator),
            ]
    finally:
        model.state.reset()


def _check_end_to_end(model, device: torch.device, grid: int, generator: torch.Generator) -> CheckResult:
    c = model.config
    dtype = model.model.embed_tokens.weight.dtype
    n = 2 * grid + grid // 2 + 1  # two full grid chunks and a tail
    ids = torch.randint(0, c.vocab_size, (n,), generator=generator).to(device)
    shape = (c.num_kv_layers, 2, c.num_kv_heads)
    cold_kv = torch.empty(*shape, n + 1, c.head_dim, dtype=dtype, device=device)
    warm_kv = garbage((*shape, n + grid + 7, c.head_dim), dtype, device)
    at_grid = {grid: model.state.empty_checkpoint(grid)}
    cold = hybrid_grid_forward(model, ids, cold_kv, 0, grid, checkpoints=at_grid)
    cold_state = model.state.snapshot()
    step = cold.argmax(dim=-1)  # [1]
    cold_step = model(step, cold_kv, n)
    warm_kv[:, :, :, :grid] = cold_kv[:, :, :, :grid]  # the first grid chunk "loaded"
    model.state.restore(at_grid[grid])
    warm = hybrid_grid_forward(model, ids[grid:], warm_kv, grid, grid)
    for what, a, b in (
        ("KV after a resumed grid chunk", cold_kv[:, :, :, :n], warm_kv[:, :, :, :n]),
        ("the GDN state after a resumed grid chunk", cold_state.data, model.state.snapshot().data),
        ("last-token logits", cold, warm),
        ("a decode step", cold_step, model(step.clone(), warm_kv, n)),
    ):
        if differs(a, b):
            return CheckResult("end to end", False, f"{what}: {differs(a, b)}")
    return CheckResult("end to end", True)
