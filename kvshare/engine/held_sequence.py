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
prefix cache keeps a block of generated tokens). An overlap shorter than a chunk is computed again.

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

    def reusable(self, digest: bytes, ids: np.ndarray, limit: int, minimum: int) -> int:
        """Leading tokens of ``ids`` whose KV the buffer holds for ``digest``, at most ``limit``; 0 below
        ``minimum`` (a chunk: a shorter overlap, such as a shared template's first tokens, is computed again, as
        the local cache and the pool would have it)."""
        if self._digest != digest or not digest:
            return 0
        m = min(len(self._ids), len(ids), limit)
        differ = np.flatnonzero(self._ids[:m] != ids[:m])
        same = int(differ[0]) if differ.size else m
        return same if same >= minimum else 0

    def forget(self) -> None:
        self._digest, self._ids = b"", np.empty(0, dtype=np.int64)

    def hold(self, digest: bytes, prompt: np.ndarray, fed: list[int]) -> None:
        """The buffer holds ``prompt`` then ``fed`` at positions [0, len(prompt) + len(fed)). Copied: the prompt
        may be the caller's array, which it may change after the request."""
        self._ids = np.concatenate([prompt, np.asarray(fed, dtype=np.int64)])
        self._digest = digest
