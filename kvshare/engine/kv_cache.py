"""The engine's sequence KV storage: one ``[L, 2, H, T_cap, D]`` tensor, reused across requests.

Its dtype is the layout's, which is also the pool pages' (``EngineConfig.kv_dtype``: the model's dtype,
or e.g. float8_e4m3fn at one byte per element, half of bf16's).

Head-major (layer, k|v, kv_head, token, head_dim) so ``kv[l, 0, :, :n]`` is the
``[H, n, D]`` key view SDPA reads directly. One request at a time owns it. The
capacity is a whole number of chunks, so chunk i is always ``kv[..., i*C:(i+1)*C, :]``::

    token axis  |chunk 0|chunk 1| ... |chunk k| tail, decode steps ... |  (T_cap)
"""

from __future__ import annotations

import torch

from kvshare.engine.held_sequence import HeldSequence
from kvshare.layout import KVLayout
from kvshare.transfer.layouts import torch_dtype


class KVBuffer:
    """Grows (never shrinks) to the largest request seen. Between requests it may hold the last request's tokens
    (``held``, set by the engine when a request ends complete); handing the tensor out forgets them, since whoever
    asks for it may write it, and so does growing it."""

    def __init__(self, layout: KVLayout, device: torch.device, max_tokens: int) -> None:
        self.layout = layout
        self.dtype = torch_dtype(layout.dtype)  # the layout's: the model's dtype, or the --kv-dtype chosen
        self.device = device
        self.max_tokens = max_tokens
        self._kv: torch.Tensor | None = None
        self.held = HeldSequence()

    @property
    def capacity(self) -> int:
        return 0 if self._kv is None else self._kv.shape[3]

    @property
    def num_bytes(self) -> int:
        return 0 if self._kv is None else self._kv.numel() * self._kv.element_size()

    def ensure(self, num_tokens: int) -> torch.Tensor:
        """The KV tensor with room for ``num_tokens`` tokens: [L, 2, H, T_cap, D], T_cap % C == 0."""
        if num_tokens > self.max_tokens:
            raise ValueError(f"{num_tokens} tokens exceed max_model_len {self.max_tokens}")
        self.held.forget()
        if self._kv is None or self.capacity < num_tokens:
            c = self.layout.chunk_tokens
            grown = min(max(num_tokens, int(self.capacity * 1.5)), self.max_tokens)  # amortise growth
            capacity = -(-grown // c) * c
            self._kv = None  # free the old tensor before allocating the new one
            shape = (self.layout.num_layers, 2, self.layout.num_kv_heads, capacity, self.layout.head_dim)
            self._kv = torch.empty(shape, dtype=self.dtype, device=self.device)
        return self._kv

    def chunk(self, kv: torch.Tensor, index: int) -> torch.Tensor:
        """View of chunk ``index``: [L, 2, H, C, D]."""
        c = self.layout.chunk_tokens
        return kv[:, :, :, index * c : (index + 1) * c, :]

    def release(self) -> None:
        self.held.forget()
        self._kv = None
