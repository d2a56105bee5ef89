"""The tier's thread-side work against an in-memory store: write-behind rules, fetch of mixed part sizes."""

import hashlib
import time

import numpy as np
import pytest

from kvshare.pool.checksum import page_checksum
from kvshare.pool.remote.breaker import OPEN, CircuitBreaker
from kvshare.pool.remote.config import RemoteConfig
from kvshare.pool.remote.format import CHECKSUM, HEADER_BYTES, PageMeta, num_parts, part_keys
from kvshare.pool.remote.store import RemoteStoreError
from kvshare.pool.remote.workers import MISS, PageToWrite, copy_pages, fetch_pages, write_pages
from tests.verdicts import spy_verdicts

pytestmark = pytest.mark.remote
PAGE = 64 << 10
NS = bytes(range(16))


class MemoryStore:
    """The RemoteStore interface over a dict; ``is_down`` makes every call fail."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.is_down = False
        self.num_calls = 0

    def _call(self):
        self.num_calls += 1
        if self.is_down:
            raise RemoteStoreError("down")

    def get(self, keys, ttl_s, max_value_bytes, deadline=None):
        self._call()
        if any(len(self.values.get(k, b"")) > max_value_bytes for k in keys):
            raise RemoteStoreError("a value over the bound")
        return [self.values.get(k) for k in keys]

    def count_existing(self, groups):
        self._call()
        return [sum(k in self.values for k in keys) for keys in groups]

    def put(self, keys, values, ttl_s=0):
        self._call()
        self.values.update(zip(keys, values))

    def expire(self, keys, ttl_s):
        self._call()

    def delete(self, keys):
        self._call()
        for k in keys:
            self.values.pop(k, None)


def setup(n=3, part_bytes=16 << 10):
    cfg = RemoteConfig("redis://h:1", prefix="w", part_bytes=part_bytes)
    arena = np.zeros(n * PAGE, dtype=np.uint8)
    pages = []
    for i in range(n):
        view = arena[i * PAGE : (i + 1) * PAGE]
        view[:] = np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8)
        key = hashlib.blake2b(bytes([i]), digest_size=16).digest()
        pages.append(PageToWrite(PageMeta(key, NS, i, PAGE, page_checksum(view)), i * PAGE))
    return cfg, arena, pages, CircuitBreaker(3, 60.0)


def write(store, breaker, cfg, arena, pages, deadline=None):
    deadline = time.monotonic() + 60 if deadline is None else deadline
    return write_pages(store, breaker, cfg, arena, pages, deadline, lambda: False)


def test_write_then_fetch_round_trip_and_existing_pages_are_skipped():
    cfg, arena, pages, breaker = setup()
    store = MemoryStore()
    result = write(store, breaker, cfg, arena, pages)
    assert (result.num_written, result.num_existing, result.num_bytes) == (3, 0, 3 * PAGE)
    assert len(store.values) == 3 * num_parts(PAGE, cfg.part_bytes)
    again = write(store, breaker, cfg, arena, pages)
    assert (again.num_written, again.num_existing) == (0, 3)
    fetched = fetch_pages(store, breaker, cfg, [p.meta.key for p in pages] + [bytes(16)], PAGE, None)
    assert len(fetched.pages) == 3 and fetched.end == MISS
    target = np.zeros_like(arena)
    sums = copy_pages(target, [(page, i * PAGE) for i, page in enumerate(fetched.pages)])
    assert np.array_equal(target, arena) and sums == [p.meta.checksum for p in pages]


def test_pages_written_with_another_part_size_are_read():
    cfg, arena, pages, breaker = setup(part_bytes=8 << 10)  # more, smaller parts than the reader expects
    store = MemoryStore()
    write(store, breaker, cfg, arena, pages)
    reader_cfg = RemoteConfig("redis://h:1", prefix="w", part_bytes=32 << 10)
    fetched = fetch_pages(store, breaker, reader_cfg, [p.meta.key for p in pages], PAGE, NS)
    assert len(fetched.pages) == 3 and fetched.end is None
    assert b"".join(fetched.pages[2].payloads) == arena[2 * PAGE :].tobytes()


def test_no_arena_byte_is_read_past_the_pin_deadline():
    cfg, arena, pages, breaker = setup()
    store = MemoryStore()
    result = write(store, breaker, cfg, arena, pages, deadline=time.monotonic() - 1)
    assert result.num_expired == 3 and result.num_written == 0 and not store.values


def test_a_page_that_fails_its_checksum_is_not_spread():
    cfg, arena, pages, breaker = setup()
    arena[PAGE + 5] ^= 1  # page 1 changed after its commit
    store = MemoryStore()
    result = write(store, breaker, cfg, arena, pages)
    assert (result.num_written, result.num_bad) == (2, 1)


@pytest.mark.parametrize("forced", [None, True], ids=["checked", "forced-valid"])
def test_write_behind_and_fetch_refuse_a_corrupt_page_through_the_one_check(monkeypatch, forced):
    """The write-behind (an arena page) and the fetch (a stored value) ask kvshare.pool.checksum.

    Fails when either compares checksums itself: forced valid, it would still refuse the page.
    """
    cfg, arena, pages, breaker = setup()
    store = MemoryStore()
    write(store, breaker, cfg, arena, pages)
    arena[PAGE + 5] ^= 1  # page 1 changed in the arena after its commit
    first_part = part_keys(cfg.prefix, pages[2].meta.key, num_parts(PAGE, cfg.part_bytes))[0]
    value = bytearray(store.values[first_part])
    value[HEADER_BYTES + 3] ^= 1  # page 2's stored bytes changed in the store
    store.values[first_part] = bytes(value)
    calls = spy_verdicts(monkeypatch, forced)
    written = write(MemoryStore(), breaker, cfg, arena, pages)
    fetched = fetch_pages(store, breaker, cfg, [p.meta.key for p in pages], PAGE, NS)
    if forced:
        assert written.num_bad == 0 and len(fetched.pages) == 3
    else:
        assert written.num_bad == 1 and len(fetched.pages) == 2 and fetched.end == CHECKSUM
    assert len(calls) == 6  # three arena pages written, three stored pages fetched


def test_store_down_opens_the_breaker_and_then_nothing_is_sent():
    cfg, arena, pages, breaker = setup()
    store = MemoryStore()
    store.is_down = True
    for _ in range(3):
        result = write(store, breaker, cfg, arena, pages)
        assert result.num_failed == 3 and result.num_errors == 1
    assert breaker.state == OPEN
    calls = store.num_calls
    assert write(store, breaker, cfg, arena, pages).num_breaker == 3
    assert fetch_pages(store, breaker, cfg, [pages[0].meta.key], PAGE, None).end == "breaker"
    assert store.num_calls == calls
