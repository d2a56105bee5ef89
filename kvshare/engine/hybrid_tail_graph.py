"""A resumed hybrid prefill's tail as CUDA graphs: the tokens between a loaded state and the prompt's last token.

A replica that resumes a prefix from a state checkpoint (the pool's, the local cache's) computes the tokens after
it: at most a chunk when the state is at the prompt's last whole chunk. That forward is tiny for the GPU (256
tokens of the 27B shape: a few ms) but launches ~70 kernels a layer, each through Python (flash-linear-attention's
delta rule alone costs ~1 ms of host time a call), so eagerly it takes ~130 ms of host time while the GPU waits:
4x the copy that loaded the prefix. Here it is the decode graphs' split (kvshare.engine.hybrid_decode_graph) over
a fixed number of rows::

    rows      |== valid: tokens [start, start + num_valid) ==|-- padding --|     one graph set per row count
    graph 0   tokens -> embed; RoPE at start + row; GDN layers; first attention layer's q/gate, K/V written
    attn j    eager: the prefill attention over kv[j, :, :, :start + rows] (lower-right causal)
    graph j   ...; the last: the remaining GDN layers (no logits: the prompt's last token is a decode step)

A set is captured for each power of two from MIN_ROWS to ``max_rows``, and a tail runs in the smallest that holds
it. The count of valid rows is a device tensor the graphs read: padding rows decay nothing and write nothing into
the GDN state (kvshare.engine.gdn), their queries see only positions before them, and the K/V they write lie past
the prompt's last token, which the step after it writes again. Everything else a graph computes for the valid rows
is what the eager forward computes; the CPU tests run the same pieces without graphs (``run_eager``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from kvshare.engine.hybrid_decode_graph import HybridDecodeGraphs
from kvshare.engine.model import attend, sdpa_backends

MIN_ROWS = 16
MAX_ROWS = 1024  # longer tails have enough work per kernel to keep the GPU busy eagerly


class HybridTailGraphs(HybridDecodeGraphs):
    """The forward of up to ``rows`` tokens that follow the model's state, over ``kv`` [L_att, 2, H, T_cap, D]."""

    def __init__(self, model, kv: Tensor, rows: int) -> None:
        super().__init__(model, kv)
        config, device = model.config, kv.device
        self.rows = rows
        self.token = torch.zeros(rows, dtype=torch.int64, device=device)
        self.position = torch.zeros(rows, dtype=torch.int64, device=device)  # start + row
        self._offsets = torch.arange(rows, dtype=torch.int64, device=device)
        self.num_valid = torch.zeros((), dtype=torch.int64, device=device)
        self.x = torch.zeros(rows, config.hidden_size, dtype=self.dtype, device=device)
        self.q = torch.zeros(config.num_heads, rows, config.head_dim, dtype=self.dtype, device=device)
        self.attn_out = torch.zeros_like(self.q)
        self.gate = torch.zeros(rows, config.num_heads * config.head_dim, dtype=self.dtype, device=device)
        self.logits = None  # the prompt's last token runs as a decode step
        self._before_layer: Callable[[int], None] | None = None

    def _end(self) -> None:
        pass

    def _attend(self, index: int, start: int) -> None:
        if self._before_layer is not None:
            self._before_layer(index)  # e.g. wait until this layer's loaded KV has arrived
        end = start + self.rows
        prefill = self.model.prefill_attention or attend
        self.attn_out.copy_(prefill(self.q, self.kv[index, 0, :, :end], self.kv[index, 1, :, :end], start))

    def _tail(self, tokens: Tensor, start: int, before_layer, piece: Callable[[int], None]) -> None:
        """tokens [n] (n <= rows, on the device) at positions [start, start + n); the state advances to start + n."""
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

    def _warm_up(self) -> None:
        self._tail(self.token, self.kv.shape[3] - self.rows, None, self._piece)

    def run_eager(self, tokens: Tensor, start: int, before_layer=None) -> None:
        """The tail without graphs (same pieces)."""
        self._tail(tokens, start, before_layer, self._piece)

    def run(self, tokens: Tensor, start: int, before_layer=None) -> None:
        """The tail by replaying the graphs (captured first if they are not)."""
        if self._graphs is None:
            self.capture()
        graphs = self._graphs
        self._tail(tokens, start, before_layer, lambda index: graphs[index].replay())


class TailGraphSet:
    """One HybridTailGraphs per row count (powers of two, MIN_ROWS to ``max_rows``), all over one KV tensor.

    ``eager``: the pieces run without graphs (where none can be captured: the CPU tests of the split)."""

    def __init__(self, model, kv: Tensor, max_rows: int = MAX_ROWS, eager: bool = False) -> None:
        self.kv, self.eager = kv, eager
        sizes, rows = [], MIN_ROWS
        while rows <= min(max_rows, kv.shape[3]):
            sizes.append(rows)
            rows *= 2
        self.tails = {rows: HybridTailGraphs(model, kv, rows) for rows in sizes}

    def capture(self) -> None:
        """Capture every row count's graphs (CUDA), each with its own memory pool: at start-up, before any sequence
        is in the KV (the warm-up writes the KV's last positions)."""
        for tail in self.tails.values():
            tail.capture()

    def holds(self, num_tokens: int, start: int) -> bool:
        """Whether a tail of ``num_tokens`` from ``start`` runs here (not too long, and its rows within the KV)."""
        tail = self._fitting(num_tokens)
        return tail is not None and (self.eager or tail.is_captured) and start + tail.rows <= self.kv.shape[3]

    def run(self, tokens: Tensor, start: int, before_layer: Callable[[int], None] | None = None) -> None:
        """The tail ``tokens`` [n] from ``start`` (``holds`` first) in the smallest row count that holds it."""
        tail = self._fitting(tokens.shape[0])
        (tail.run_eager if self.eager else tail.run)(tokens, start, before_layer)

    def _fitting(self, num_tokens: int) -> HybridTailGraphs | None:
        return next((tail for rows, tail in self.tails.items() if num_tokens <= rows), None)
