"""The local prefix cache: longest chained prefix, LRU by bytes, chains evicted from their ends."""

from __future__ import annotations

import torch

from kvshare.engine.prefix_cache import LocalPrefixCache

CHUNK_BYTES = 4 * 4  # a [4] float32 tensor stands in for a chunk


def chunk(value: float) -> torch.Tensor:
    return torch.full((4,), float(value))


def keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def insert_chain(cache: LocalPrefixCache, ks: list[bytes]) -> None:
    for i in reversed(range(len(ks))):  # as the engine does: tail first
        cache.insert(ks[i], chunk(i))


def test_longest_prefix_stops_at_the_first_gap():
    cache = LocalPrefixCache(10 * CHUNK_BYTES)
    a = keys("a", 4)
    insert_chain(cache, [a[0], a[1]])
    cache.insert(a[3], chunk(3))
    found = cache.longest_prefix(a)
    assert [float(c[0]) for c in found] == [0.0, 1.0]
    assert (cache.counters.hit_chunks, cache.counters.miss_chunks) == (2, 2)


def test_values_are_copies():
    cache = LocalPrefixCache(CHUNK_BYTES)
    source = chunk(1.0)
    cache.insert(b"k", source)
    source.fill_(5.0)
    assert float(cache.longest_prefix([b"k"])[0][0]) == 1.0


def test_lru_by_bytes_keeps_the_heads_of_chains():
    cache = LocalPrefixCache(5 * CHUNK_BYTES)
    a, b = keys("a", 3), keys("b", 3)
    insert_chain(cache, a)
    insert_chain(cache, b)  # 6 chunks into room for 5: a's tail goes first
    assert cache.num_bytes == 5 * CHUNK_BYTES and a[2] not in cache and a[0] in cache
    assert len(cache.longest_prefix(a)) == 2  # touching a makes b the least recently used
    cache.insert(b"c0", chunk(9))
    assert b[2] not in cache and b[0] in cache
    assert cache.counters.evicted_chunks == 2


def test_a_chunk_larger_than_the_cache_is_not_kept():
    cache = LocalPrefixCache(CHUNK_BYTES - 1)
    assert not cache.insert(b"k", chunk(0)) and len(cache) == 0


def test_a_device_out_of_memory_caps_the_cache_and_keeps_a_prefix_head(monkeypatch, caplog):
    """A configured size that does not fit the device (another replica beside it, the sequence KV)
    stops the cache where it stands: it makes room within what it holds (a chain's tail first) and
    takes the chunk, or refuses it. Never an error for the request that offered the chunk."""
    from kvshare.engine import prefix_cache

    cache = LocalPrefixCache(10 * CHUNK_BYTES)
    a, b = keys("a", 3), keys("b", 3)
    insert_chain(cache, a)
    real = prefix_cache._copy_of

    def room_for_three(chunk):
        if len(cache) >= 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 36.00 MiB.")
        return real(chunk)

    monkeypatch.setattr(prefix_cache, "_copy_of", room_for_three)
    assert cache.insert(b[0], chunk(9)) is True
    assert cache.capacity_bytes == 3 * CHUNK_BYTES and cache.counters.out_of_memory == 1
    assert "out of memory" in caplog.text and "--local-cache-size" in caplog.text
    assert a[2] not in cache and b[0] in cache  # the tail of a's chain made room
    assert [float(c[0]) for c in cache.longest_prefix(a)] == [0.0, 1.0]
    assert cache.insert(b[1], chunk(8)) is True and cache.counters.out_of_memory == 1  # within the cap: no OOM

    def no_room(chunk):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(prefix_cache, "_copy_of", no_room)
    assert cache.insert(b[2], chunk(7)) is False  # refused, not raised
    assert cache.num_bytes <= cache.capacity_bytes < 3 * CHUNK_BYTES
