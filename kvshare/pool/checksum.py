"""Page checksums, of two kinds; the kind is recorded with the checksum at commit and travels with the lease.

``XXH3``
    xxh3-64 over the page's bytes (tens of GB/s on a host core): what CPU writers record.
``WSUM32``
    a position-weighted sum of the page's little-endian *signed* 32-bit words, mod 2**64::

        wsum32(page) = sum_i (i + 1) * int32(word_i)   mod 2**64,   i = 0 .. n_words - 1

    Modular addition is associative and commutative, so any order of summation gives the
    same value: a GPU computes it with torch int64 reductions over the staged bytes (in
    pieces, kvshare.pool.wsum), the host with numpy uint64 (below), bit for bit alike.
    What it catches: any change confined to one word (a flipped byte, a torn write of a
    word) changes the sum by (i + 1) * d with 0 < |d| < 2**32 and i + 1 < 2**32, a nonzero
    number below 2**64 in magnitude, so never 0 mod 2**64; likewise any swap of two words
    ((i - j) * (w_j - w_i)). Pages must hold a whole number of words and fewer than 2**32.

Unknown kinds are refused when a message is decoded (the protocol types the field).

This module is the one verification point of every path that reads a committed page (both engines'
loads, the vLLM connector's, the pool client's ``read_checked``, the remote tier's write-behind and
fetch): ``is_valid`` says whether a page's bytes match its header, ``checksum_is_valid`` whether a
checksum computed in pieces beside the copies does (the one comparison); ``PageSampler`` draws the
pages a load checks and ``PageHasher`` is the threads that hash them. Callers decide only what to do
with a bad page (drop it, recompute from it, refuse a remote value)::

    page bytes + header  -- is_valid -->  page_checksum: xxh3 / numpy WSUM32 (host), kvshare.pool.wsum (GPU tensor)
                                                |
    pieces summed beside the copies  --------> checksum_is_valid(header, checksum)  -->  valid, or not
    (WSUM32 of staged rows on a GPU, a streamed xxh3)
"""

from __future__ import annotations

import enum
import random
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
import xxhash

from kvshare.pool.wsum import MOD64, block_words, page_sums

PARALLEL_MIN_BYTES = 64 << 20  # PageHasher: below this, thread hand-off costs more than it saves


class ChecksumKind(enum.IntEnum):
    XXH3 = 1
    WSUM32 = 2


class Recorded(Protocol):
    """What a page's header recorded of its bytes at commit (a lease's PageHeader, a remote value's PageMeta)."""

    checksum: int
    checksum_kind: int


def is_valid(page, header: Recorded) -> bool:
    """Whether ``page``'s bytes are those ``header`` recorded at commit: its checksum, of its kind.

    ``page``: the page's bytes as a host view (numpy array, memoryview, bytes) or a torch tensor (on a GPU,
    WSUM32 is summed there). False: the page must not be used.
    """
    return checksum_is_valid(header, page_checksum(page, ChecksumKind(header.checksum_kind)))


def checksum_is_valid(header: Recorded, checksum: int) -> bool:
    """Whether ``checksum``, computed over a page's bytes as they are now, is the one ``header`` recorded.

    The comparison every check of a page ends in: ``is_valid`` over a whole page, or a caller that
    summed the page in pieces beside its copies (WSUM32 over staged rows on a GPU, xxh3 streamed
    layer by layer) with the kernel of ``header``'s kind.
    """
    return checksum == header.checksum


def page_checksum(data, kind: ChecksumKind = ChecksumKind.XXH3) -> int:
    """64-bit checksum of a page's bytes, of ``kind``: a bytes-like object (a numpy array or memoryview of
    a page) or a torch tensor (its bytes in memory order; on a GPU, WSUM32 is summed there)."""
    torch = sys.modules.get("torch")  # a tensor exists only where torch was imported
    if torch is not None and isinstance(data, torch.Tensor):
        if kind == ChecksumKind.WSUM32 and data.device.type != "cpu":
            return int(page_sums(data.reshape(1, -1))[0]) % MOD64
        data = data.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    if kind == ChecksumKind.XXH3:
        return xxhash.xxh3_64_intdigest(data)
    if kind == ChecksumKind.WSUM32:
        return wsum32(data)
    raise ValueError(f"unknown checksum kind {kind!r}; known: {[k.name for k in ChecksumKind]}")


def wsum32(data) -> int:
    """``WSUM32`` of ``data``, computed on the host.

    Words as a [M, K] matrix, word i = m * K + k, weight i + 1 = m * K + (k + 1)::

        sum_i (i + 1) w_i = K * sum_m m * rowsum_m + sum_k (k + 1) * colsum_k

    Row and column sums of int32 are exact in int64 (K * 2**31 and M * 2**31 at most);
    the weighted sums are taken mod 2**64 in uint64 (numpy wraps arrays silently).
    """
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    if raw.size % 4:
        raise ValueError(f"a WSUM32 checksum needs a whole number of 32-bit words; got {raw.size} bytes")
    words = raw.view("<i4")
    if words.size >= 1 << 32:
        raise ValueError("a WSUM32 checksum covers fewer than 2**32 words")
    k = block_words(words.size)
    matrix = words.reshape(-1, k)
    rows = matrix.sum(axis=1, dtype=np.int64).view(np.uint64)  # [M]
    cols = matrix.sum(axis=0, dtype=np.int64).view(np.uint64)  # [K]
    by_row = int((rows * np.arange(rows.size, dtype=np.uint64)).sum(dtype=np.uint64))
    by_col = int((cols * np.arange(1, k + 1, dtype=np.uint64)).sum(dtype=np.uint64))
    return (k * by_row + by_col) % MOD64


def wsum32_reference(data) -> int:
    """The definition, word by word with Python integers (tests only: slow)."""
    words = np.frombuffer(bytes(data), dtype="<i4")
    return sum((i + 1) * int(w) for i, w in enumerate(words)) % MOD64


class PageSampler:
    """Which pages of the loads a reader checks: all at ``fraction`` 1, none at 0, else that share of them.

    A credit grows by ``fraction`` per page; a page is drawn when the credit exceeds a uniform draw
    from [0, 1), which then costs it 1. The credit stays in (-1, 1), so over any number of pages the
    share checked is exact to within one page, and the draws move which pages those are, so a bad
    page has no position that is never checked.
    """

    def __init__(self, fraction: float, rng: random.Random | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"verify_fraction must lie in [0, 1], got {fraction}")
        self.fraction = fraction
        self._rng = rng or random.Random()
        self._credit = 0.0

    def draw(self) -> bool:
        """Whether the next page is checked."""
        if self.fraction >= 1.0:
            return True
        self._credit += self.fraction
        if self._credit > self._rng.random():
            self._credit -= 1.0
            return True
        return False

    def choose(self, num_pages: int) -> list[int]:
        """Indices of the next ``num_pages`` pages that are checked."""
        return [i for i in range(num_pages) if self.draw()]


class PageHasher:
    """The threads that hash pages: xxhash and numpy release the GIL, so hashing a 32 GiB load on 8 threads
    takes a fraction of its copy's time. Started on first use, stopped by ``close()``.

    ``initializer`` runs once in each thread (vLLM's CPU worker moves them off its OpenMP cores).
    """

    def __init__(self, num_threads: int, initializer: Callable[[], None] | None = None) -> None:
        self._num_threads = max(1, num_threads)
        self._initializer = initializer
        self._pool: ThreadPoolExecutor | None = None

    def checksums(self, pages: Sequence, kind: ChecksumKind = ChecksumKind.XXH3) -> list[int]:
        """The checksum of ``kind`` of each page (host views of the pages' bytes), for a commit."""
        if self._is_serial(pages):
            return [page_checksum(page, kind) for page in pages]
        return list(self._executor().map(page_checksum, pages, [kind] * len(pages)))

    def valid(self, pages: Sequence, headers: Sequence[Recorded]) -> list[bool]:
        """``is_valid`` of each page against its header."""
        if self._is_serial(pages):
            return [is_valid(page, header) for page, header in zip(pages, headers)]
        return list(self._executor().map(is_valid, pages, headers))

    def submit_valid(self, page, header: Recorded) -> Future[bool]:
        """``is_valid`` of the page, on one of the threads while the caller goes on (the page must not change)."""
        return self._executor().submit(is_valid, page, header)

    def _is_serial(self, pages: Sequence) -> bool:
        return self._num_threads == 1 or sum(_num_bytes(page) for page in pages) < PARALLEL_MIN_BYTES

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self._num_threads, thread_name_prefix="kvshare-checksum", initializer=self._initializer
            )
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _num_bytes(page) -> int:
    return page.nbytes if hasattr(page, "nbytes") else len(page)
