"""A hybrid model's decode step as CUDA graphs: one graph for everything between two attention calls.

As kvshare.engine.decode_graph for the attention models, with the Gated DeltaNet layers inside the graphs:
their one-token step (conv state shift, recurrent update) has the same shapes at every position and reads and
writes the GDN state's buffer in place, whose address never changes. With Qwen3.5-27B's 64 layers a step is
17 graph replays and 16 attention calls::

    graph 0   token -> embed; RoPE at the position; GDN layers 0-2; layer 3: norm, q/gate/k/v, K/V written
    attn 0    eager: SDPA over kv[0, :, :, :position + 1]
    graph j   attention layer a(j-1): gate, o_proj, MLP; the GDN layers up to a(j); layer a(j) started
    ...
    graph 16  the last attention layer finished (and any GDN layers after it); final norm; logits (float32)

The GDN state must end at the step's position before a step (the model's rule: kvshare.engine.gdn_state), and
is one token further after it. Capturing runs one eager step first, as capture needs: on a copy of the state
put back afterwards, so a sequence being decoded keeps its state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kvshare.engine.decode_graph import DecodeGraphs
from kvshare.engine.model import rope_cos_sin_at, write_kv_at


class HybridDecodeGraphs(DecodeGraphs):
    """The pieces of one decode step of a HybridTransformer over ``kv`` [L_att, 2, H, T_cap, D]."""

    def __init__(self, model, kv: Tensor) -> None:
        super().__init__(model, kv)
        config = model.config
        self.gate = torch.zeros(1, config.num_heads * config.head_dim, dtype=self.dtype, device=kv.device)
        layers = model.model.layers
        self.attention = [i for i, layer in enumerate(layers) if layer.is_attention]  # model layer of each call

    @property
    def num_layers(self) -> int:
        """Attention calls per step (the pieces between them are the graphs)."""
        return len(self.attention)

    def _piece(self, index: int) -> None:
        """Graph ``index``: the end of attention layer index-1 (or the embedding), the GDN layers after it, and the
        start of attention layer ``index`` (or the final norm and logits)."""
        layers = self.model.model.layers
        if index == 0:
            self.x.copy_(self.model.model.embed_tokens(self.token))
            self._cos, self._sin = rope_cos_sin_at(self.model.inv_freq, self.position, self.dtype)
            first = 0
        else:
            self._finish_layer(index - 1)
            first = self.attention[index - 1] + 1
        end = self.attention[index] if index < self.num_layers else len(layers)
        for i in range(first, end):
            self._linear(i)
        if index < self.num_layers:
            self._start_layer(index)
        else:
            self._end()

    def _linear(self, layer: int) -> None:
        """GDN layer ``layer`` over the rows, its state advanced in place."""
        state, slot = self.model.state, self.model.slot[layer]
        self.x.copy_(self.model.model.layers[layer].linear_step(self.x, state.recurrent[slot], state.conv[slot]))

    def _end(self) -> None:
        """The last graph's end: the final norm and the logits."""
        self.model.logits(self.model.model.norm(self.x), self.logits)

    def _start_layer(self, index: int) -> None:
        layer = self.model.model.layers[self.attention[index]]
        q, k, v, gate = layer.self_attn.qkv(layer.input_layernorm(self.x), self._cos, self._sin)
        self.q.copy_(q.transpose(0, 1))
        self.gate.copy_(gate)
        write_kv_at(self.kv[index], self.position, k, v)

    def _finish_layer(self, index: int) -> None:
        layer = self.model.model.layers[self.attention[index]]
        o = self.attn_out.transpose(0, 1).reshape(self.x.shape[0], -1)  # [rows, Hq*D]
        self.x.copy_(layer.mlp_residual(self.x + layer.self_attn.output(o, self.gate)))

    def _run(self, token_id: int, position: int, piece: Callable[[int], None]) -> Tensor:
        self.model.begin(position)  # the state must end where the step starts (position > 0: a prompt came first)
        logits = super()._run(token_id, position, piece)
        self.model.state.position = position + 1
        return logits

    def capture(self) -> None:
        """As DecodeGraphs.capture, the GDN state kept: the warm-up step runs on it and it is put back after."""
        kept = self.model.state.snapshot()
        try:
            self.model.state.position = self.kv.shape[3] - self.x.shape[0]  # where the warm-up's rows start
            super().capture()
        finally:
            self.model.state.restore(kept)
