"""A hybrid prefill's tail as CUDA graphs: the tokens after a resumed state, the prompt's last token among them.

A replica that resumes a prefix from a state checkpoint (the pool's, the local cache's) computes the tokens after
it: at most a chunk when the state is at the prompt's last whole chunk. That forward is small for the GPU (256
tokens of the 27B shape: ~20 ms) but launches ~70 kernels a layer, each through Python (flash-linear-attention's
delta rule alone costs ~1 ms of host time a call), so eagerly it takes ~130 ms of host time while the GPU waits:
4x the copy that loaded the prefix. Here it is the decode graphs' split (kvshare.engine.hybrid_decode_graph) over
a fixed number of rows, the last token in them (a decode step after the tail would read the weights again)::

    rows      |== valid: tokens [start, start + num_valid) ==|-- padding --|     one graph set per row count
    graph 0   tokens -> embed; RoPE at start + row; GDN layers; first attention layer's q/gate, K/V written
    attn j    eager: the prefill attention over kv[j, :, :, :start + rows] (lower-right causal)
    graph j   ...; the last: the remaining GDN layers, the final norm and the logits of the last valid row
    GDN layer the rows before the last valid one chunked, the state then copied to ``before_last`` (the prompt-end
              checkpoint: the same prompt again computes its last token alone), the last row stepped

A set is captured for each power of two from MIN_ROWS to ``max_rows``, and a tail runs in the smallest that holds
it. The count of valid rows is a device tensor the graphs read: padding rows decay nothing and write nothing into
the GDN state (kvshare.engine.gdn), their queries see only positions before them, and the K/V they write lie past
the prompt, where the decode steps write again. Everything else a graph computes for the valid rows is what the
eager forward cut at the last token computes; the CPU tests run the same pieces without graphs (``run_eager``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from kvshare.engine.gdn_state import layer_views
from kvshare.engine.hybrid_decode_graph import HybridDecodeGraphs
from kvshare.engine.model import attend, sdpa_backends

MIN_ROWS = 16
MAX_ROWS = 1024  # longer tails have enough work per kernel to keep the GPU busy eagerly


class HybridTailGraphs(HybridDecodeGraphs):
    """The forward of up to ``rows`` tokens that follow the model's state, over ``kv`` [L_att, 2, H, T_cap, D];
    the state before the last of them lands in ``before_last`` (a GDN state's bytes, shared by a set's graphs)."""

    def __init__(self, model, kv: Tensor, rows: int, before_last: Tensor) -> None:
        super().__init__(model, kv)
        config, device = model.config, kv.device
        self.rows = rows
        self.token = torch.zeros(rows, dtype=torch.int64, device=device)
        self.position = torch.zeros(rows, dtype=torch.int64, device=device)  # start + row
        self._offsets = torch.arange(rows, dtype=torch.int64, device=device)
        self.num_valid = torch.ones((), dtype=torch.int64, device=device)
        self.x = torch.zeros(rows, config.hidden_size, dtype=self.dtype, device=device)
        self.q = torch.zeros(config.num_heads, rows, config.head_dim, dtype=self.dtype, device=device)
        self.attn_out = torch.zeros_like(self.q)
        self.gate = torch.zeros(rows, config.num_heads * config.head_dim, dtype=self.dtype, device=device)
        self._before_last = layer_views(model.state.layout, before_last)
        self._before_layer: Callable[[int], None] | None = None

    def _linear(self, layer: int) -> None:
        state, slot = self.model.state, self.model.slot[layer]
        into = (self._before_last[0][slot], self._before_last[1][slot])
        out = self.model.model.layers[layer].linear_step(
            self.x, state.recurrent[slot], state.conv[slot], self.num_valid, into
        )
        self.x.copy_(out)

    def _end(self) -> None:
        last = self.x.index_select(0, (self.num_valid - 1).reshape(1))  # [1, E]
        self.model.logits(self.model.model.norm(last), self.logits)

    def _attend(self, index: int, start: int) -> None:
        if self._before_layer is not None:
            self._before_layer(index)  # e.g. wait until this layer's loaded KV has arrived
        end = start + self.rows
        prefill = self.model.prefill_attention or attend
        self.attn_out.copy_(prefill(self.q, self.kv[index, 0, :, :end], self.kv[index, 1, :, :end], start))

    def _tail(self, tokens: Tensor, start: int, before_layer, piece: Callable[[int], None]) -> Tensor:
        """tokens [n] (n <= rows, on the device) at positions [start, start + n); the state advances to start + n.
        The logits [1, V] float32 of the last token (valid until the next run)."""
        num_tokens = tokens.shape[0]
        if not 0 < num_tokens <= self.rows or start + self.rows > self.kv.shape[3]:
            raise ValueError(
                f"a tail of {num_tokens} tokens from {start} does not fit {self.rows} rows within the KV capacity "
                f"{self.kv.shape[3]}"
            )
        self.model.begin(start)  # the state must end where the tail starts
        self.token[num_tokens:].zero_()
        self.token[:num_tokens].copy_(tokens)
        torch.add(self._offsets, start, out=self.position)
        self.num_valid.fill_(num_tokens)
        self._before_layer = before_layer
        try:
            with sdpa_kernel(sdpa_backends(self.kv.is_cuda, self.rows), set_priority=True):
                for index in range(self.num_layers):
                    piece(index)
                    self._attend(index, start)
                piece(self.num_layers)
        finally:
            self._before_layer = None
        self.model.state.position = start + num_tokens
        return self.logits

    def _warm_up(self) -> None:
        self._tail(self.token, self.kv.shape[3] - self.rows, None, self._piece)

    def run_eager(self, tokens: Tensor, start: int, before_layer=None) -> Tensor:
        """The tail without graphs (same pieces)."""
        return self._tail(tokens, start, before_layer, self._piece)

    def run(self, tokens: Tensor, start: int, before_layer=None) -> Tensor:
        """The tail by replaying the graphs (captured first if they are not)."""
        if self._graphs is None:
            self.capture()
        graphs = self._graphs
        return self._tail(tokens, start, before_layer, lambda index: graphs[index].replay())


class TailGraphSet:
    """One HybridTailGraphs per row count (powers of two, MIN_ROWS to ``max_rows``), all over one KV tensor.

    ``before_last``: the state before the last token of the last run (bytes in the GDN state's layout).
    ``eager``: the pieces run without graphs (where none can be captured: the CPU tests of the split)."""

    def __init__(self, model, kv: Tensor, max_rows: int = MAX_ROWS, eager: bool = False) -> None:
        self.kv, self.eager = kv, eager
        self.before_last = torch.zeros_like(model.state.buffer)
        sizes, rows = [], MIN_ROWS
        while rows <= min(max_rows, kv.shape[3]):
            sizes.append(rows)
            rows *= 2
        self.tails = {rows: HybridTailGraphs(model, kv, rows, self.before_last) for rows in sizes}

    def capture(self) -> None:
        """Capture every row count's graphs (CUDA), each with its own memory pool: at start-up, before any sequence
        is in the KV (the warm-up writes the KV's last positions)."""
        for tail in self.tails.values():
            tail.capture()

    def holds(self, num_tokens: int, start: int) -> bool:
        """Whether a tail of ``num_tokens`` from ``start`` runs here (not too long, and its rows within the KV)."""
        tail = self._fitting(num_tokens)
        return tail is not None and (self.eager or tail.is_captured) and start + tail.rows <= self.kv.shape[3]

    def run(self, tokens: Tensor, start: int, before_layer: Callable[[int], None] | None = None) -> Tensor:
        """The tail ``tokens`` [n] from ``start`` (``holds`` first) in the smallest row count that holds it: the
        logits of its last token (valid until the next run)."""
        tail = self._fitting(tokens.shape[0])
        return (tail.run_eager if self.eager else tail.run)(tokens, start, before_layer)

    def _fitting(self, num_tokens: int) -> HybridTailGraphs | None:
        return next((tail for rows, tail in self.tails.items() if num_tokens <= rows), None)
