"""A hybrid's decode step as CUDA graphs (kvshare.engine.hybrid_decode_graph).

On CPU: the pieces between the attention calls, run eagerly, compute exactly what HybridTransformer.forward
computes for one token (logits, K/V, the GDN state, bit for bit), and a step must start where the state ends.
On CUDA (``-m gpu``, tests/engine/test_hybrid_gpu.py): replayed graphs against the eager step.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.hybrid_decode_graph import HybridDecodeGraphs
from kvshare.engine.presets import build_preset


@pytest.fixture(scope="module")
def tiny():
    model, config, _ = build_preset("qwen3.5-tiny", torch.device("cpu"))
    return model, config


def _kv(config, capacity: int = 96) -> torch.Tensor:
    return torch.zeros(config.num_kv_layers, 2, config.num_kv_heads, capacity, config.head_dim)


def test_the_pieces_compute_what_the_forward_computes(tiny):
    model, config = tiny
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    kv = _kv(config)
    with torch.inference_mode():
        model(ids, kv, 0)
    after_prompt = model.state.snapshot()
    eager_kv, steps = kv.clone(), [(40, 7), (41, 200), (42, 3)]
    with torch.inference_mode():
        expected = [model(torch.tensor([token]), eager_kv, position) for position, token in steps]
        eager_state = model.state.snapshot()
        model.state.restore(after_prompt)
        pieces = HybridDecodeGraphs(model, kv)
        assert pieces.num_layers == config.num_kv_layers  # a piece between every two attention calls
        got = [pieces.run_eager(token, position).clone() for position, token in steps]
    for position, a, b in zip((40, 41, 42), got, expected):
        assert torch.equal(a, b), position
    assert torch.equal(kv[:, :, :, :43], eager_kv[:, :, :, :43])
    assert torch.equal(model.state.buffer, eager_state.data) and model.state.position == 43


def test_a_step_must_start_where_the_state_ends(tiny):
    model, config = tiny
    with torch.inference_mode():
        model(torch.zeros(10, dtype=torch.int64), _kv(config), 0)
        with pytest.raises(ValueError, match="holds the first 10 tokens"):
            HybridDecodeGraphs(model, _kv(config)).run_eager(1, 12)
