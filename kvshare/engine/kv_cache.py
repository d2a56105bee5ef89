"""The engine's sequence KV: one ``[L, 2, H, T_cap, D]`` tensor reused across requests (``KVBuffer``), and what
it still holds when a request ends (``HeldSequence``): a prompt and the tokens its decode fed, reused in place.

Its dtype is the layout's, which is also the pool pages' (``EngineConfig.kv_dtype``: the model's dtype,
or e.g. float8_e4m3fn at one byte per element, half of bf16's).

Head-major (layer, k|v, kv_head, token, head_dim) so ``kv[l, 0, :, :n]`` is the
``[H, n, D]`` key view SDPA reads directly. One request at a time owns it. The
capacity is a whole number of chunks, so chunk i is always ``kv[..., i*C:(i+1)*C, :]``::

    token axis  |chunk 0|chunk 1| ... |chunk k| tail, decode steps ... |  (T_cap)

When a request ends, positions [0, n + fed) of the buffer hold the KV of its prompt and of every generated
token its decode steps fed back (not the last one sampled): its ``HeldSequence``. A next request of the same
namespace (model, tenant) whose prompt starts with those tokens reuses them in place, to the token, where the
local cache and the pool reuse whole chunks only::

    held       |======== last prompt ========|== its fed answer ==|
    prompt     |======== last prompt ========|== its fed answer ==|-- new turn --|
    reused     |================ in place, no copy ================|
    chunks     |=== local cache / pool ===|                    a chunk reuse stops at the last whole chunk

The same prompt again computes its last token alone; a chat's next turn on the same replica computes its
new turn alone (the chunks it then publishes carry the answer's KV as its decode steps computed it, as vLLM's
prefix cache keeps a block of generated tokens), whatever their lengths, a prompt shorter than a chunk included.

Any overlap o of a prompt of at most a chunk is reused, and of a longer prompt of n tokens one of at least a
chunk or n / 2; a shorter one (a shared template's first tokens under a long prompt) is computed again. Reused,
the suffix's attention runs over the whole prefix with a lower-right causal mask, which SDPA on CPU materialises:
(n - o) * n scores against a cold prefill's causal n^2 / 2, so a short overlap under a long prompt costs more
than the o tokens it saves; up to a chunk the difference is a fraction of a millisecond. One layer's attention,
tiny's heads, 2 CPU cores shared at load ~15, best of 7 (benchmarks/suffix_attention_cost.py, 2026-12-07):
256 tokens cold 0.58 ms, with 1 token in place 0.80 ms; 2048 tokens 111 ms, 347 ms, with 1024 in place 163 ms;
8192 tokens 1.28 s, 3.80 s, 1.62 s::

    n <= chunk   |== o ==|--- computed ---|                       any o: reused
    o >= n / 2   |====== in place ======|--- computed ---|        attention (n - o) * n <= n^2 / 2: reused
    o <  n / 2   |== o ==|-------------- computed --------------|  (and o < a chunk): computed again from token 0

The buffer forgets what it holds whenever its tensor is handed out, to a request or anything else that may
write it, and when it grows; the engine sets it again only when a request ended with its KV complete: the
prompt's and each token its decode fed back. So a request that failed or was cancelled before its first token,
or is still running, leaves nothing to reuse; nor do chunks found wrong (the audit) or the engine's
deterministic mode (its reuse is on the grid, kvshare.engine.grid).
"""

from __future__ import annotations

import numpy as np
import torch

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


class HeldSequence:
    def __init__(self) -> None:
        self._digest = b""  # the namespace (model, tenant) the KV was computed for
        self._ids = np.empty(0, dtype=np.int64)

    def reusable(self, digest: bytes, ids: np.ndarray, limit: int, chunk_tokens: int) -> int:
        """Leading tokens of ``ids`` whose KV the buffer holds for ``digest``, at most ``limit``; 0 where ``ids`` is
        longer than a chunk and they are fewer than both a chunk and half of it (computed again: see the module's
        docstring)."""
        if self._digest != digest or not digest:
            return 0
        m = min(len(self._ids), len(ids), limit)
        differ = np.flatnonzero(self._ids[:m] != ids[:m])
        same = int(differ[0]) if differ.size else m
        floor = 1 if len(ids) <= chunk_tokens else min(chunk_tokens, (len(ids) + 1) // 2)
        return same if same >= floor else 0

    def forget(self) -> None:
        self._digest, self._ids = b"", np.empty(0, dtype=np.int64)

    def hold(self, digest: bytes, prompt: np.ndarray, fed: list[int]) -> None:
        """The buffer holds ``prompt`` then ``fed`` at positions [0, len(prompt) + len(fed)). Copied: the prompt
        may be the caller's array, which it may change after the request."""
        self._ids = np.concatenate([prompt, np.asarray(fed, dtype=np.int64)])
        self._digest = digest
