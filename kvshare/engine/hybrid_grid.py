"""The deterministic mode for a hybrid model: every layer on one fixed grid from position 0, the GDN's too.

kvshare.engine.grid makes the attention models' prefill chunk-invariant: positions cut into grid chunks of G
tokens from position 0, each computed with the same calls on the same shapes (the tail zero-padded to G) in
every run. A hybrid adds the Gated DeltaNet layers, whose chunked rule cuts its tokens into blocks of 64 counted
from the first token it is given; so it is given exactly one grid chunk at a time, from the state the grid
chunk before it left::

    positions  |--- grid 0 ---|--- grid 1 ---|--- grid 2 ---|-- tail --......|
    GDN layer  S0 -> rule(G rows) -> S1 -> rule(G rows) -> S2 -> rule(G rows, the tail's padding masked) -> S3
    attention  as kvshare.engine.grid: projections on G rows, queries [s, e) over keys [0, e)

G is a multiple of the pool's chunk and of the rule's block (64). A prefill that resumes at a grid boundary
from the state a run computed there (a checkpoint) makes exactly the calls that run made from there on, on equal
bits, so its KV, states and logits equal that run's bit for bit; the padding of a tail has strength and decay 0,
so it leaves the state as the valid rows leave it. The start-up self-test (kvshare.engine.hybrid_grid_check)
checks this on the engine's device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from kvshare.engine.gdn import CHUNK_SIZE
from kvshare.engine.gdn_state import Checkpoint
from kvshare.engine.grid import grid_backends, pad_rows
from kvshare.engine.model import attend, rope_cos_sin, write_kv


def hybrid_grid_forward(
    model,
    tokens: Tensor,
    kv: Tensor,
    start: int,
    grid_tokens: int,
    before_layer: Callable[[int], None] | None = None,
    all_logits: bool = False,
    checkpoints: Mapping[int, Checkpoint] | None = None,
) -> Tensor:
    """Prefill ``tokens`` [T] at [start, start+T) on the grid (``start`` on a grid boundary, the model's GDN state
    there) -> float32 logits as HybridTransformer.forward. ``checkpoints``: grid boundaries -> empty checkpoints."""
    num_tokens = tokens.shape[0]
    if grid_tokens % CHUNK_SIZE:
        raise ValueError(f"a hybrid's grid must be a multiple of {CHUNK_SIZE} tokens, got {grid_tokens}")
    if start % grid_tokens:
        raise ValueError(f"a grid prefill starts on the grid: position {start} is not a multiple of {grid_tokens}")
    if num_tokens < 1 or start + num_tokens > kv.shape[3]:
        raise ValueError(f"positions {start}..{start + num_tokens} do not fit the KV capacity {kv.shape[3]}")
    spans = [(a, min(num_tokens, a + grid_tokens)) for a in range(0, num_tokens, grid_tokens)]  # rows of x
    checkpoints = checkpoints or {}
    off_grid = sorted(set(checkpoints) - {start + b for _, b in spans})
    if off_grid:
        raise ValueError(f"checkpoints off the grid's boundaries: {off_grid}")
    state = model.begin(start)
    decoder = model.model
    x = decoder.embed_tokens(tokens)  # [T, E]
    ropes = [rope_cos_sin(model.inv_freq, start + a, grid_tokens, x.dtype) for a, _ in spans]  # [G, rotary] each
    attention = model.prefill_attention or attend
    last = len(decoder.layers) - 1
    last_only = not all_logits and decoder.layers[last].is_attention
    with sdpa_kernel(grid_backends(x.device), set_priority=True):
        for i, layer in enumerate(decoder.layers):
            slot = model.slot[i]
            if not layer.is_attention:
                _grid_linear_layer(layer, x, spans, grid_tokens, state, slot, start, checkpoints)
                continue
            for j, ((a, b), (cos, sin)) in enumerate(zip(spans, ropes)):
                wait = (lambda slot=slot: before_layer(slot)) if before_layer is not None and j == 0 else None
                if i == last and last_only:
                    h = pad_rows(x[a:b], grid_tokens)
                    q, gate = _grid_qkv(layer, h, b - a, kv[slot], start + a, cos, sin, wait)
                    gate = gate[: b - a]  # the rows of the chunk's tokens (the last one's is read)
                else:
                    _grid_step(layer, x[a:b], kv[slot], start + a, cos, sin, grid_tokens, wait, attention)
        state.position = start + num_tokens
        if last_only:
            # the last layer's K/V are written for every token; only the last token's row attends and runs its MLP
            h = _last_token(decoder.layers[last], x[-1:], q[-1:], gate[-1:], kv[model.slot[last]], start + num_tokens)
            return model.logits_of(h, 1)
    out = torch.empty(num_tokens, model.config.vocab_size, dtype=torch.float32, device=x.device)
    for a, b in spans:
        out[a:b] = model.logits_of(pad_rows(x[a:b], grid_tokens), grid_tokens)[: b - a]
    return out


def _grid_linear_layer(layer, x: Tensor, spans, grid_tokens: int, state, slot: int, start: int, checkpoints) -> None:
    """A GDN layer over x [T, E] (updated in place), one grid chunk at a time (its rows padded to G) from the state
    the one before left; the state after a span that ends at a checkpoint's position is copied into it."""
    for a, b in spans:
        out = layer.linear_step(pad_rows(x[a:b], grid_tokens), state.recurrent[slot], state.conv[slot], b - a)
        x[a:b] = out[: b - a]
        if start + b in checkpoints:
            state.copy_layer(slot, checkpoints[start + b])


def _grid_qkv(
    layer, h: Tensor, m: int, kv: Tensor, start: int, cos: Tensor, sin: Tensor, wait
) -> tuple[Tensor, Tensor]:
    """One attention layer's K/V of one grid chunk from its m rows padded to the grid (h [G, E]), written at
    [start, start + m); returns its queries [m, Hq, D] and gate [G, Hq*D]."""
    q, k, v, gate = layer.self_attn.qkv(layer.input_layernorm(h), cos, sin)
    write_kv(kv, start, k[:m], v[:m])
    if wait is not None:
        wait()
    return q[:m], gate


def _grid_step(layer, x: Tensor, kv: Tensor, start: int, cos: Tensor, sin: Tensor, grid_tokens: int, wait, attention):
    """One attention layer over one grid chunk: x [m, E] rows at [start, start+m), m <= G (updated in place)."""
    m = x.shape[0]
    h = pad_rows(x, grid_tokens)  # [G, E]
    q, gate = _grid_qkv(layer, h, m, kv, start, cos, sin, wait)
    out = attention(q.transpose(0, 1), kv[0, :, : start + m], kv[1, :, : start + m], start)  # [Hq, m, D]
    o = pad_rows(out.transpose(0, 1).reshape(m, -1), grid_tokens)  # [G, Hq*D]
    x.copy_(layer.mlp_residual(h + layer.self_attn.output(o, gate))[:m])


def _last_token(layer, x: Tensor, q: Tensor, gate: Tensor, kv: Tensor, end: int) -> Tensor:
    """The attention layer's output [1, E] for the token at end-1 (x [1, E], q [1, Hq, D], gate [1, Hq*D])."""
    out = attend(q.transpose(0, 1), kv[0, :, :end], kv[1, :, :end], end - 1)  # [Hq, 1, D]: one query, no mask
    return layer.mlp_residual(x + layer.self_attn.output(out.transpose(0, 1).reshape(1, -1), gate))
