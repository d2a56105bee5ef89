"""The deterministic mode for the hybrid (kvshare.engine.hybrid_grid): a prefill resumed at a grid boundary from a
state computed there equals one prefill from position 0 bit for bit (KV, GDN state, logits; float32 on CPU), the
self-test refuses GDN kernels that are not repeatable, and an engine's local reuse equals recomputing exactly."""

from __future__ import annotations

import pytest
import torch

from kvshare.engine import gdn
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.engine.gdn_state import layer_views
from kvshare.engine.grid_check import GridCheckFailed, require_exact_grid
from kvshare.engine.hybrid_grid import hybrid_grid_forward
from kvshare.engine.hybrid_grid_check import check_hybrid_grid
from kvshare.engine.presets import build_preset

GRID = 64
NO_LOCAL = RequestOptions(use_local_cache=False)


@pytest.fixture(scope="module")
def tiny():
    model, config, _ = build_preset("qwen3.5-tiny", torch.device("cpu"))
    return model, config


def _kv(config, capacity: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((config.num_kv_layers, 2, config.num_kv_heads, capacity, config.head_dim), fill)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("resume_at", [GRID, 2 * GRID])
def test_a_prefill_resumed_from_a_checkpoint_equals_one_prefill_bit_for_bit(tiny, resume_at):
    model, config = tiny
    n = 3 * GRID + 21  # three grid chunks and a tail
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(resume_at))
    cold_kv = _kv(config, n + 1)
    at = {p: model.state.empty_checkpoint(p) for p in (GRID, 2 * GRID)}
    with torch.inference_mode():
        cold = hybrid_grid_forward(model, ids, cold_kv, 0, GRID, all_logits=True, checkpoints=at)
        cold_state = model.state.snapshot()
        warm_kv = _kv(config, n + 3 * GRID, float("nan"))  # another capacity; every position not loaded is NaN
        warm_kv[:, :, :, :resume_at] = cold_kv[:, :, :, :resume_at]
        model.state.restore(at[resume_at])
        warm = hybrid_grid_forward(model, ids[resume_at:], warm_kv, resume_at, GRID, all_logits=True)
        warm_state = model.state.snapshot()
    assert _bits_equal(cold_kv[:, :, :, :n], warm_kv[:, :, :, :n])
    assert _bits_equal(cold_state.data, warm_state.data) and warm_state.position == n
    assert _bits_equal(cold[resume_at:], warm)


def test_the_last_token_path_equals_the_all_logits_path_and_resumes_exactly(tiny):
    """Without all_logits the last attention layer runs the last token alone: the same bits whichever prefix was
    reused (the engine's prefill)."""
    model, config = tiny
    n = 2 * GRID + 5
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(9))
    at = {GRID: model.state.empty_checkpoint(GRID)}
    with torch.inference_mode():
        kv = _kv(config, n)
        cold = hybrid_grid_forward(model, ids, kv, 0, GRID, checkpoints=at)
        model.state.restore(at[GRID])
        warm = hybrid_grid_forward(model, ids[GRID:], kv.clone(), GRID, GRID)
        every = hybrid_grid_forward(model, ids, _kv(config, n), 0, GRID, all_logits=True)
    assert _bits_equal(cold, warm)
    assert (cold - every[-1:]).abs().max().item() < 1e-4  # the same token's logits by another path


def test_checkpoints_and_starts_off_the_grid_are_refused(tiny):
    model, config = tiny
    ids = torch.zeros(2 * GRID, dtype=torch.int64)
    with torch.inference_mode(), pytest.raises(ValueError, match="off the grid"):
        hybrid_grid_forward(model, ids, _kv(config, 2 * GRID), 0, GRID, checkpoints={GRID + 1: None})
    with torch.inference_mode(), pytest.raises(ValueError, match="starts on the grid"):
        hybrid_grid_forward(model, ids, _kv(config, 3 * GRID), 7, GRID)


def test_the_self_test_passes_here_and_refuses_a_gdn_kernel_that_is_not_repeatable(tiny, monkeypatch):
    model, _config = tiny
    results = require_exact_grid(model, torch.device("cpu"), GRID, check_hybrid_grid)
    assert [r.name for r in results] == ["attention", "end to end"] and all(r.is_exact for r in results)
    assert model.state.position == 0  # the check leaves the state reset
    calls = iter(range(10**6))
    exact = gdn.chunk_gated_delta_rule

    def drifting(*args, **kwargs):  # a kernel whose result depends on how often it ran: not repeatable
        return exact(*args, **kwargs) * (1 + 1e-6 * (next(calls) % 3))

    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", drifting)
    with pytest.raises(GridCheckFailed, match="end to end"):
        require_exact_grid(model, torch.device("cpu"), GRID, check_hybrid_grid)


def test_an_engines_local_reuse_equals_recomputing_bit_for_bit():
    """Prompts that share 2.5 grid chunks: the second resumes from the checkpoint at 2 chunks (its local cache
    holds the state every 2 chunks), and its logprobs equal a cold run's exactly."""
    engine = Engine(
        EngineConfig(model="qwen3.5-tiny", chunk_tokens=GRID, deterministic=True, state_checkpoint_chunks=2)
    )
    try:
        assert engine.grid is not None and engine.grid.kernel_build.endswith("|gdn torch")
        first = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
        second = first[:160] + [7] * 90
        params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)

        def run(ids, options=RequestOptions()):
            events = list(engine.generate(ids, params, options))
            return [(e.token_id, e.logprob) for e in events], events[0].provenance

        run(first)
        warm, provenance = run(second)
        cold, cold_provenance = run(second, NO_LOCAL)
    finally:
        engine.close()
    assert (provenance.local_tokens, provenance.computed_tokens) == (128, 122) and provenance.is_deterministic
    assert cold_provenance.local_tokens == 0
    assert warm == cold  # token ids and float32 logprobs, bit for bit


def test_a_tails_padding_leaves_the_state_as_its_valid_rows_leave_it(tiny):
    """The last grid chunk's rows past the prompt are padding: the GDN state after a grid prefill is the state the
    prompt's own tokens leave (as the fast forward computes it), so decoding goes on from the right state."""
    model, config = tiny
    n = GRID + 10
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        hybrid_grid_forward(model, ids, _kv(config, n + 1), 0, GRID)
        on_grid = model.state.snapshot()
        model(ids, _kv(config, n + 1), 0)
        fast = model.state.snapshot()
    for a, b in zip(*(layer_views(model.state.layout, s.data)[0] for s in (on_grid, fast))):
        assert (a - b).abs().max().item() < 1e-5
    for a, b in zip(*(layer_views(model.state.layout, s.data)[1] for s in (on_grid, fast))):
        assert torch.equal(a, b)  # the conv state: the last 3 inputs of the prompt's own rows
