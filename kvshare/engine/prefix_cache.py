"""The local prefix cache (the study's "local reuse"): chunk KV kept in engine memory, LRU by bytes.

Entries are keyed by the same chained chunk keys as the pool (kvshare.keys), so a
hit on key i implies the whole prefix up to chunk i matches. Values are chunk KV in
engine layout, ``[L, 2, H, C, D]``, copied out of (and back into) the sequence KV.
A lookup touches the matched chunks tail first, so the head of a prefix is always the
most recently used: eviction takes chains from their ends, never from their starts.

A hybrid model's chunks are of use only up to a state checkpoint (kvshare.state_layout: the GDN state at the
end of a chunk), so beside its KV chunks the cache keeps checkpoints, each under ``state_key`` of the chunk it
ends, in the same LRU and byte bound; ``longest_resumable`` is its lookup. Checkpoints are never announced as
KV blocks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvshare.engine.prefix_events import PrefixCacheEvents, open_prefix_events
from kvshare.keys import state_key

if TYPE_CHECKING:
    from kvshare.pool.event_publisher import KVEventsConfig

log = logging.getLogger(__name__)


@dataclass
class PrefixCacheCounters:
    hit_chunks: int = 0
    miss_chunks: int = 0
    inserted_chunks: int = 0
    evicted_chunks: int = 0
    out_of_memory: int = 0  # inserts the device had no room for (each one capped the capacity)


def _copy_of(chunk: torch.Tensor) -> torch.Tensor:
    return chunk.clone(memory_format=torch.contiguous_format)


class LocalPrefixCache:
    def __init__(self, capacity_bytes: int, kv_events: KVEventsConfig | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        # told of every prompt inserted, every removal and clear; with ``kv_events`` it publishes them
        self.listener: PrefixCacheEvents | None = open_prefix_events(kv_events)
        self.counters = PrefixCacheCounters()
        self._chunks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> [L, 2, H, C, D], or a checkpoint
        self._checkpoint_keys: set[bytes] = set()  # the state_key entries of _chunks

    def __len__(self) -> int:
        """KV chunks held (checkpoints not counted)."""
        return len(self._chunks) - len(self._checkpoint_keys)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoint_keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._chunks

    def longest_prefix(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """Chunks held for the longest prefix of ``keys`` (marked most recently used)."""
        found = []
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is None:
                break
            found.append(chunk)
        for key in reversed(keys[: len(found)]):
            self._chunks.move_to_end(key)
        self.counters.hit_chunks += len(found)
        self.counters.miss_chunks += len(keys) - len(found)
        return found

    def longest_resumable(
        self, keys: Sequence[bytes], first: int = 0, is_resumable: Callable[[int], bool] = lambda _n: True
    ) -> tuple[int, list[torch.Tensor], torch.Tensor | None]:
        """A hybrid model's lookup: the longest prefix of ``keys`` that ends where a checkpoint is held (under
        state_key of its last chunk) and ``is_resumable(its number of chunks)``, as (its chunks, the KV chunks of
        it from chunk ``first`` on, the checkpoint's bytes); (0, [], None) where none is. Chunks before ``first``
        count as held (the caller holds their KV in place). Chunks held past the prefix are not returned: a state is
        never combined with KV beyond it. The chunks used are marked most recently used, the checkpoint last."""
        held = first
        while held < len(keys) and keys[held] in self._chunks:
            held += 1
        used = next((n for n in range(held, 0, -1) if is_resumable(n) and state_key(keys[n - 1]) in self._chunks), 0)
        from_cache = max(0, used - first)
        self.counters.hit_chunks += from_cache
        self.counters.miss_chunks += len(keys) - first - from_cache
        if not used:
            return 0, [], None
        for key in reversed(keys[first:used]):
            self._chunks.move_to_end(key)
        checkpoint = state_key(keys[used - 1])
        self._chunks.move_to_end(checkpoint)
        return used, [self._chunks[key] for key in keys[first:used]], self._chunks[checkpoint]

    def insert_checkpoint(self, key: bytes, data: torch.Tensor) -> bool:
        """Keep ``data`` (a checkpoint's bytes, owned by the cache from now on: not copied) as the state at the end of
        the chunk keyed ``key``; False when one is held already or it can never fit."""
        checkpoint = state_key(key)
        if self.insert(checkpoint, data, copy=False):
            self._checkpoint_keys.add(checkpoint)
            return True
        return False

    def insert(self, key: bytes, chunk: torch.Tensor, copy: bool = True) -> bool:
        """Keep a copy of ``chunk`` under ``key`` (``chunk`` itself without ``copy``); False when it is held already
        or can never fit."""
        if key in self._chunks:
            self._chunks.move_to_end(key)
            return False
        size = chunk.numel() * chunk.element_size()
        # a device out of memory (the configured size does not fit beside what else holds it: another
        # replica on the same GPU, the sequence KV) caps the cache at what it holds; it then makes room
        # within that (tails first, so a prefix's head stays) and tries once more. Never an error for
        # the request that offered the chunk.
        for _attempt in range(2):
            if size > self.capacity_bytes:
                return False
            self._evict_until(self.capacity_bytes - size)
            try:
                value = _copy_of(chunk) if copy else chunk
                break
            except torch.OutOfMemoryError:
                self._cap(self.num_bytes)
        else:
            return False
        self._chunks[key] = value
        self.num_bytes += size
        self.counters.inserted_chunks += 1
        return True

    def insert_prompt(self, keys: Sequence[bytes], chunk_of: Callable[[int], torch.Tensor], ids=None) -> None:
        """Insert a prompt's chunks (``chunk_of(i)``: chunk i's KV), tail first so the head ends up most recently
        used, then announce them to the listener with ``ids`` (the prompt's token ids; None: a tenant's)."""
        for i in reversed(range(len(keys))):
            self.insert(keys[i], chunk_of(i))
        if self.listener is not None:
            self.listener.stored(keys, ids, self.__contains__)

    def discard(self, keys: Sequence[bytes]) -> int:
        """Remove these chunks (found wrong by an audit) and the checkpoints at their ends; returns how many chunks
        were held."""
        removed = 0
        for key in keys:
            if self._remove(state_key(key)) is not None:
                self._checkpoint_keys.discard(state_key(key))
            chunk = self._remove(key)
            if chunk is not None:
                removed += 1
                if self.listener is not None:
                    self.listener.removed(key)
        return removed

    def _remove(self, key: bytes) -> torch.Tensor | None:
        chunk = self._chunks.pop(key, None)
        if chunk is not None:
            self.num_bytes -= chunk.numel() * chunk.element_size()
        return chunk

    def clear(self) -> None:
        self._chunks.clear()
        self._checkpoint_keys.clear()
        self.num_bytes = 0
        if self.listener is not None:
            self.listener.cleared()

    def close(self) -> None:
        """Clear, and stop publishing."""
        self.clear()
        if self.listener is not None:
            self.listener.close()

    def _cap(self, capacity_bytes: int) -> None:
        self.counters.out_of_memory += 1
        log.warning(
            "local prefix cache: the device is out of memory at %.2f GiB held (configured %.2f GiB); "
            "capped there: lower --local-cache-size or --max-model-len, or run fewer replicas on this device",
            capacity_bytes / 2**30,
            self.capacity_bytes / 2**30,
        )
        self.capacity_bytes = capacity_bytes

    def _evict_until(self, limit_bytes: int) -> None:
        while self.num_bytes > limit_bytes and self._chunks:
            key, chunk = self._chunks.popitem(last=False)
            self.num_bytes -= chunk.numel() * chunk.element_size()
            if key in self._checkpoint_keys:
                self._checkpoint_keys.discard(key)
                continue
            self.counters.evicted_chunks += 1
            if self.listener is not None:
                self.listener.removed(key)
