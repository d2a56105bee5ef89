"""Decode steps replayed as CUDA graphs: one launch for everything between two attentions.

An eager decode step of the 8B shape launches ~2000 small kernels (norms, projections, RoPE, the MLP)
for ~4 ms of GPU work, so the host's launches set its pace (~33 ms a step on the H200, and more when
the replica's event loop takes the GIL). Here the work between two attention calls is one captured
graph, so a step is L + 1 graph replays and L attention calls::

    graph 0        token -> embed; RoPE at the position; layer 0: norm, q/k/v, K/V written at the position
    attention 0    eager: SDPA over kv[0, :, :, :position + 1] (its length grows every step)
    graph l        layer l-1: o_proj, residual, MLP; layer l: norm, q/k/v, K/V written
    ...
    graph L        layer L-1: o_proj, residual, MLP; final norm; logits (float32)

Attention stays eager because its key length changes every step; everything else has the same shapes
at every position, and the position enters the graphs as a device tensor (RoPE and the K/V write read it
there). The pieces call the model's own modules and functions in the order ``Transformer.forward`` does
for one token, so a replay computes what the eager step computes; ``run_eager`` runs the same pieces
without graphs (how the CPU tests check the split). Graphs are captured for one KV tensor (its storage
is read and written in them) and captured again when the engine hands over another.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from kvshare.engine.model import Transformer, attend, rope_cos_sin_at, sdpa_backends, write_kv_at


class DecodeGraphs:
    """The pieces of one decode step over ``kv`` [L, 2, H, T_cap, D], with static inputs and outputs."""

    def __init__(self, model: Transformer, kv: Tensor) -> None:
        self.model = model
        self.kv = kv
        config = model.config
        weight = model.model.embed_tokens.weight
        device, self.dtype = weight.device, weight.dtype
        self.token = torch.zeros(1, dtype=torch.int64, device=device)  # static inputs, set before each step
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.x = torch.zeros(1, config.hidden_size, dtype=self.dtype, device=device)  # the residual stream
        self.q = torch.zeros(config.num_heads, 1, config.head_dim, dtype=self.dtype, device=device)  # [Hq, 1, D]
        self.attn_out = torch.zeros_like(self.q)  # attention's output, copied in eagerly
        self.logits = torch.zeros(1, config.vocab_size, dtype=torch.float32, device=device)
        self._cos = self._sin = None
        self._graphs: list[torch.cuda.CUDAGraph] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    @property
    def is_captured(self) -> bool:
        return self._graphs is not None

    # -- the pieces (each reads and writes only the static tensors above and the KV) -------------------

    def _piece(self, index: int) -> None:
        """Graph ``index``: the end of layer index-1 (or the embedding) and the start of layer ``index``
        (or the final norm and logits)."""
        if index == 0:
            self.x.copy_(self.model.model.embed_tokens(self.token))
            self._cos, self._sin = rope_cos_sin_at(self.model.inv_freq, self.position, self.dtype)
        else:
            self._finish_layer(index - 1)
        if index < self.num_layers:
            self._start_layer(index)
        else:
            self.model.logits(self.model.model.norm(self.x), self.logits)

    def _start_layer(self, index: int) -> None:
        layer = self.model.model.layers[index]
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(self.x), self._cos, self._sin)
        self.q.copy_(q.transpose(0, 1))
        write_kv_at(self.kv[index], self.position, k, v)

    def _finish_layer(self, index: int) -> None:
        layer = self.model.model.layers[index]
        o = self.attn_out.transpose(0, 1).reshape(1, -1)  # [1, Hq*D]
        h = self.x + layer.self_attn.o_proj(o)
        self.x.copy_(h + layer.mlp(layer.post_attention_layernorm(h)))

    def _attend(self, index: int, position: int) -> None:
        end = position + 1
        self.attn_out.copy_(attend(self.q, self.kv[index, 0, :, :end], self.kv[index, 1, :, :end], position))

    # -- running a step ----------------------------------------------------------------------------------

    def _set_inputs(self, token_id: int, position: int) -> None:
        if position + 1 > self.kv.shape[3]:
            raise ValueError(f"position {position} exceeds the KV capacity {self.kv.shape[3]}")
        self.token.fill_(token_id)
        self.position.fill_(position)

    def _run(self, token_id: int, position: int, piece: Callable[[int], None]) -> Tensor:
        self._set_inputs(token_id, position)
        with sdpa_kernel(sdpa_backends(self.kv.is_cuda, 1), set_priority=True):
            for index in range(self.num_layers):
                piece(index)
                self._attend(index, position)
        piece(self.num_layers)
        return self.logits

    def run_eager(self, token_id: int, position: int) -> Tensor:
        """One step without graphs (same pieces): logits [1, V] float32, valid until the next step."""
        return self._run(token_id, position, self._piece)

    def capture(self) -> None:
        """Capture the L + 1 graphs (CUDA). Runs one eager step on a side stream first, as capture needs: at
        the KV's last position, which a request that is decoding has not written yet (its step writes it after)."""
        side = torch.cuda.Stream(self.kv.device)
        side.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(side):  # warm-up: cuBLAS handles, lazily probed kernels (model._mm_to_float32)
            self._warm_up()
        torch.cuda.current_stream(self.kv.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()  # replayed one after another: they share one memory pool
        graphs = []
        for index in range(self.num_layers + 1):
            graph = torch.cuda.CUDAGraph()
            # thread_local: the pool link's threads may use CUDA meanwhile (a store beside the decode)
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._piece(index)
            graphs.append(graph)
        self._graphs = graphs

    def _warm_up(self) -> None:
        """The eager step capture needs before it: at the KV's last position (capture's docstring)."""
        self._run(0, self.kv.shape[3] - 1, self._piece)

    def run(self, token_id: int, position: int) -> Tensor:
        """One step by replaying the graphs: logits [1, V] float32, valid until the next step."""
        if self._graphs is None:
            self.capture()
        graphs = self._graphs
        return self._run(token_id, position, lambda index: graphs[index].replay())
