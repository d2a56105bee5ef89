"""Full-pool level: every page of a pool of the requested size allocated, written, verified.

Pages are reserved through the daemon's real allocator until it refuses, so the
check proves the allocator hands out the whole arena. Each page gets its own
pattern (a counter offset by the page number, as uint64 words), so a page that
aliases another or lands at the wrong offset fails. Memory beyond the arena is
O(page size): one pattern and one scratch page per thread; time is linear in the pool size.
Fault-in, pinning (CUDA registration), write and verify are timed separately.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

NAMESPACE = hashlib.blake2b(b"kvshare-validate-full-pool", digest_size=16).digest()


@dataclass
class FullPoolResult:
    arena_bytes: int
    page_bytes: int
    num_pages: int = 0
    expected_pages: int = 0
    bad_pages: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # fault_in, pin, write, verify
    pinned: str = "not attempted"

    @property
    def passed(self) -> bool:
        return self.num_pages == self.expected_pages and not self.bad_pages and self.num_pages > 0


def _keys(start: int, count: int) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(start, start + count)]


def check_full_pool(
    client,
    page_bytes: int,
    pin: Callable[[], str] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    corrupt_page: int | None = None,
    num_threads: int | None = None,
) -> FullPoolResult:
    """Reserve every page, fault in, pin (optional), write patterns, verify; then abort the reservations.

    ``corrupt_page``: a negative control that flips one byte of that page after writing.
    ``num_threads``: pages are split among this many threads (numpy releases the GIL on whole-page
    operations, and page faults of shared memory proceed in parallel); default min(8, cores).
    """
    arena = client.hello.arena_bytes
    result = FullPoolResult(arena_bytes=arena, page_bytes=page_bytes)
    extent = client.hello.extent_bytes
    result.expected_pages = sum(min(extent, arena - base) // page_bytes for base in range(0, arena, extent))
    batch = 4096
    reservations, pages = [], []
    while True:
        res = client.reserve(NAMESPACE, _keys(len(pages), batch), page_bytes, first_depth=len(pages))
        if res.reservation_id:
            reservations.append(res.reservation_id)
        pages += [offset for _, offset in res.grants]
        if res.num_no_room or not res.grants:
            break
    result.num_pages = len(pages)
    words = page_bytes // 8
    pattern = np.arange(words, dtype=np.uint64)
    num_threads = max(1, num_threads or min(8, os.cpu_count() or 1))

    def fault_in(i: int, offset: int, scratch) -> bool:
        client.page(offset, page_bytes)[::4096] = 0  # first touch of every OS page
        return True

    def write(i: int, offset: int, scratch) -> bool:
        view = client.page(offset, page_bytes)[: words * 8].view(np.uint64)
        np.add(pattern, np.uint64(i) << np.uint64(40), out=view)
        return True

    def verify(i: int, offset: int, scratch) -> bool:
        view = client.page(offset, page_bytes)[: words * 8].view(np.uint64)
        np.add(pattern, np.uint64(i) << np.uint64(40), out=scratch)
        return bool(np.array_equal(view, scratch))

    try:
        result.seconds["fault_in"] = _timed_phase("fault-in", fault_in, pages, words, num_threads, progress)[0]
        if pin is not None:
            t0 = time.perf_counter()
            result.pinned = pin()
            result.seconds["pin"] = time.perf_counter() - t0
        result.seconds["write"] = _timed_phase("write", write, pages, words, num_threads, progress)[0]
        if corrupt_page is not None and pages:
            client.page(pages[corrupt_page % len(pages)], page_bytes)[page_bytes // 2] ^= 0xFF
        result.seconds["verify"], result.bad_pages = _timed_phase("verify", verify, pages, words, num_threads, progress)
    finally:
        for reservation_id in reservations:
            client.abort(reservation_id)
    return result


def _timed_phase(phase: str, work, pages: list[int], words: int, num_threads: int, progress) -> tuple[float, list[int]]:
    """Run ``work(i, offset, scratch) -> ok`` on every page, split in contiguous slices among threads;
    returns (seconds, indices of pages where it returned False, sorted)."""
    start = time.perf_counter()
    lock = threading.Lock()
    done = [0]
    total = len(pages)

    def run_slice(lo: int, hi: int) -> list[int]:
        scratch = np.empty(words, dtype=np.uint64)  # one page per thread: memory stays O(threads x page)
        bad = []
        for i in range(lo, hi):
            if not work(i, pages[i], scratch):
                bad.append(i)
            if (i - lo) % 64 == 63 or i == hi - 1:
                with lock:
                    done[0] += (i - lo) % 64 + 1
                    if progress is not None:
                        progress(phase, done[0], total)
        return bad

    bounds = [(total * k // num_threads, total * (k + 1) // num_threads) for k in range(num_threads)]
    bounds = [(lo, hi) for lo, hi in bounds if hi > lo]
    if len(bounds) <= 1:
        bad = run_slice(0, total) if total else []
    else:
        with ThreadPoolExecutor(max_workers=len(bounds), thread_name_prefix=f"full-pool-{phase}") as workers:
            bad = sorted(i for part in workers.map(lambda b: run_slice(*b), bounds) for i in part)
    return time.perf_counter() - start, bad
