"""What the engine's sequence KV still holds when a request ends: a prompt and the tokens its decode fed.

The engine runs one request at a time in one sequence buffer (kvshare.engine.kv_cache). When a request
ends, positions [0, n + fed) of that buffer hold the KV of its prompt and of every generated token its
decode steps fed back (not the last one sampled). A next request of the same namespace (model, tenant)
whose prompt starts with those tokens reuses them in place, to the token, where the local cache and the
pool reuse whole chunks only::

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

The buffer (kvshare.engine.kv_cache.KVBuffer) forgets what it holds whenever its tensor is handed out, to a
request or anything else that may write it, and when it grows; the engine sets it again only when a request
ended with its KV complete: the prompt's and each token its decode fed back. So a request that failed or was
cancelled before its first token, or is still running, leaves nothing to reuse; nor do chunks found wrong (the
audit) or the engine's deterministic mode (its reuse is on the grid, kvshare.engine.grid).
"""

from __future__ import annotations

import numpy as np


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
