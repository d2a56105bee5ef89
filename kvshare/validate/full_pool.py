"""Full-pool level: every page of a pool of the requested size allocated, written, verified.

Pages are reserved through the daemon's real allocator until it refuses, so the
check proves the allocator hands out the whole arena. Each page gets its own
pattern (a counter offset by the page number, as uint64 words), so a page that
aliases another or lands at the wrong offset fails. Memory beyond the arena is
O(page size): one pattern and one scratch page; time is linear in the pool size.
Fault-in, pinning (CUDA registration), write and verify are timed separately.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable

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
) -> FullPoolResult:
    """Reserve every page, fault in, pin (optional), write patterns, verify; then abort the reservations.

    ``corrupt_page``: a negative control that flips one byte of that page after writing.
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
    scratch = np.empty(words, dtype=np.uint64)
    try:
        t0 = time.perf_counter()
        for i, offset in enumerate(pages):
            client.page(offset, page_bytes)[:: 4096] = 0  # first touch of every OS page
            _tick(progress, "fault-in", i, len(pages))
        result.seconds["fault_in"] = time.perf_counter() - t0
        if pin is not None:
            t0 = time.perf_counter()
            result.pinned = pin()
            result.seconds["pin"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i, offset in enumerate(pages):
            view = client.page(offset, page_bytes)[: words * 8].view(np.uint64)
            np.add(pattern, np.uint64(i) << np.uint64(40), out=view)
            _tick(progress, "write", i, len(pages))
        result.seconds["write"] = time.perf_counter() - t0
        if corrupt_page is not None and pages:
            client.page(pages[corrupt_page % len(pages)], page_bytes)[page_bytes // 2] ^= 0xFF
        t0 = time.perf_counter()
        for i, offset in enumerate(pages):
            view = client.page(offset, page_bytes)[: words * 8].view(np.uint64)
            np.add(pattern, np.uint64(i) << np.uint64(40), out=scratch)
            if not np.array_equal(view, scratch):
                result.bad_pages.append(i)
            _tick(progress, "verify", i, len(pages))
        result.seconds["verify"] = time.perf_counter() - t0
    finally:
        for reservation_id in reservations:
            client.abort(reservation_id)
    return result


def _tick(progress, phase: str, i: int, total: int) -> None:
    if progress is not None and (i % 64 == 0 or i == total - 1):
        progress(phase, i + 1, total)
