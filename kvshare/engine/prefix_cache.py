"""The local prefix cache (the study's "local reuse"): chunk KV kept in engine memory, LRU by bytes.

Entries are keyed by the same chained chunk keys as the pool (kvshare.keys), so a
hit on key i implies the whole prefix up to chunk i matches. Values are chunk KV in
engine layout, ``[L, 2, H, C, D]``, copied out of (and back into) the sequence KV.
A lookup touches the matched chunks tail first, so the head of a prefix is always the
most recently used: eviction takes chains from their ends, never from their starts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvshare.engine.prefix_events import PrefixCacheEvents, open_prefix_events

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
        self._chunks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> [L, 2, H, C, D]

    def __len__(self) -> int:
        return len(self._chunks)

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

    def insert(self, key: bytes, chunk: torch.Tensor) -> bool:
        """Keep a copy of ``chunk`` under ``key``; False when it is held already or can never fit."""
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
                copy = _copy_of(chunk)
                break
            except torch.OutOfMemoryError:
                self._cap(self.num_bytes)
        else:
            return False
        self._chunks[key] = copy
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
        """Remove these chunks (found wrong by an audit); returns how many were held."""
        removed = 0
        for key in keys:
            chunk = self._chunks.pop(key, None)
            if chunk is not None:
                self.num_bytes -= chunk.numel() * chunk.element_size()
                removed += 1
                if self.listener is not None:
                    self.listener.removed(key)
        return removed

    def clear(self) -> None:
        self._chunks.clear()
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
            self.counters.evicted_chunks += 1
            if self.listener is not None:
                self.listener.removed(key)
