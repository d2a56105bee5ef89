"""Page checksums for transfers: each page's checksum of its kind (kvshare.pool.checksum), on a few
threads when there is much to hash.

xxhash releases the GIL, so hashing a 32 GiB store on 8 threads takes a fraction
of the copy's time instead of more than it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

from kvshare.pool.checksum import ChecksumKind, page_checksum

PARALLEL_MIN_BYTES = 64 << 20  # below this, thread hand-off costs more than it saves


class PageHasher:
    """Checksums of whole pages of one size in one client's arena."""

    def __init__(self, client, page_bytes: int, num_threads: int) -> None:
        self._client = client
        self._page_bytes = page_bytes
        self._num_threads = max(1, num_threads)
        self._pool: ThreadPoolExecutor | None = None  # started on first use, stopped by close()

    def checksum(self, offset: int, kind: ChecksumKind = ChecksumKind.XXH3) -> int:
        return page_checksum(self._client.page(offset, self._page_bytes), kind)

    def checksums(self, offsets: Sequence[int], kinds: Sequence[ChecksumKind] | None = None) -> list[int]:
        """The checksum of each page, of its kind (``kinds``, one per page; None: all xxh3)."""
        kinds = [ChecksumKind.XXH3] * len(offsets) if kinds is None else list(kinds)
        if self._num_threads == 1 or len(offsets) * self._page_bytes < PARALLEL_MIN_BYTES:
            return [self.checksum(offset, kind) for offset, kind in zip(offsets, kinds)]
        return list(self._executor().map(self.checksum, offsets, kinds))

    def submit(self, offset: int, kind: ChecksumKind) -> "Future[int]":
        """The page's checksum, computed on one of the threads while the caller goes on (the page must not change)."""
        return self._executor().submit(self.checksum, offset, kind)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="kvshare-checksum")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
