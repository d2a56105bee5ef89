"""Where a hybrid model's prefill resumes: the hit rule over the states it can reach, local and in the pool.

A GDN state sums up every token before it, so a prefix of j chunks is resumed only with the state after chunk j and
the KV of chunks 1..j. One lookup finds both (kvshare.engine.pool_states)::

    keys       | in place |==== local chunks ====|========= pool run =========|           (n-1 tokens at most)
               0        first                   held                        m
    states     live / prompt end (in place)   local checkpoints <= m    pool checkpoints <= m (the pool's lookup)
    resumed    the deepest j of them: KV of chunks [first, min(held, j)) from the local cache, [held, j) from the
               pool, the state from wherever j's checkpoint is (local first); nothing past j is used

So a local state at i is never combined with pool KV beyond i, nor the pool's state with KV beyond its j. In the
deterministic mode only grid boundaries count (``is_resumable``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvshare.engine.gdn_state import Checkpoint
from kvshare.engine.pool_states import PoolHit, PoolStates
from kvshare.engine.prefix_cache import LocalPrefixCache
from kvshare.keys import state_key


@dataclass(frozen=True)
class PoolPart:
    """What a resume takes from the pool: KV pages for chunks first_chunk.. (``num_chunks``) of ``hit``, and its
    checkpoint (the state after ``state_at`` chunks) where ``has_state``."""

    hit: PoolHit
    first_chunk: int
    num_chunks: int
    has_state: bool
    state_at: int


@dataclass
class Resume:
    """Where a prefill starts: ``position`` tokens reused, the state there (``checkpoint``; None: the model's live
    state, zeros at 0, or the pool's), the local cache's chunks to copy in first (chunk indices from
    ``first_chunk``), and what comes from the pool."""

    position: int = 0
    checkpoint: Checkpoint | None = None
    first_chunk: int = 0
    chunks: list[torch.Tensor] = field(default_factory=list)
    pool: PoolPart | None = None


@dataclass(frozen=True)
class ResumeQuery:
    """One prefill's question: its chunk keys up to ``reusable`` chunks, the chunks held in place (``first``), the
    deepest in-place state (``best``), and which chunk counts a state may be resumed at."""

    keys: list[bytes]
    first: int
    best: Resume
    chunk_tokens: int
    is_resumable: Callable[[int], bool]


def find_resume(query: ResumeQuery, local: LocalPrefixCache | None, pool: PoolStates | None) -> Resume:
    """The deepest state ``local`` (None: not used) and ``pool`` (None: not used) reach beyond ``query.best``, with
    the KV before it (module docstring); ``query.best`` when none is deeper."""
    keys, first, c = query.keys, query.first, query.chunk_tokens
    held = local.held_from(keys, first) if local is not None else first
    local_at = _deepest_local(local, keys, held, 0, query.is_resumable)
    hit, pool_at, reach = PoolHit(), 0, held
    if pool is not None:
        floor = max(query.best.position, local_at * c)
        wanted = [j for j in range(len(keys), 0, -1) if j * c > floor and query.is_resumable(j)]
        hit = pool.lookup(keys[held:], [(state_key(keys[j - 1]), max(0, j - held)) for j in wanted])
        reach = held + len(hit.pages)
        pool_at = wanted[hit.state.index] if hit.state is not None else 0
        local_at = max(local_at, _deepest_local(local, keys, reach, held, query.is_resumable))  # pool KV before it
    at = max(local_at, pool_at)
    if at * c <= query.best.position:
        if pool is not None:
            pool.release(hit)
        if local is not None:
            local.take(keys, first, first, with_checkpoint=False)  # counted: nothing used
        return query.best
    from_pool = pool_at > local_at
    chunks = local.take(keys, first, min(held, at), with_checkpoint=False)[0] if local is not None else []
    checkpoint = None if from_pool else Checkpoint(at * c, local.checkpoint(keys[at - 1]))
    part = None
    if at > held or from_pool:
        part = PoolPart(hit, held, max(0, at - held), from_pool, at)
    elif pool is not None:
        pool.release(hit)
    return Resume(at * c, checkpoint, first, chunks, part)


def _deepest_local(local: LocalPrefixCache | None, keys: list[bytes], upto: int, above: int, is_resumable) -> int:
    """The deepest j in (above, upto] whose checkpoint the local cache holds; 0 when none is (or no cache)."""
    if local is None:
        return 0
    return next((j for j in range(upto, above, -1) if is_resumable(j) and local.has_checkpoint(keys[j - 1])), 0)
