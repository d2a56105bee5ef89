"""Page checksums, of two kinds; the kind is recorded with the checksum at commit and travels with the lease.

``XXH3``
    xxh3-64 over the page's bytes (tens of GB/s on a host core): what CPU writers record.
``WSUM32``
    a position-weighted sum of the page's little-endian *signed* 32-bit words, mod 2**64::

        wsum32(page) = sum_i (i + 1) * int32(word_i)   mod 2**64,   i = 0 .. n_words - 1

    Modular addition is associative and commutative, so any order of summation gives the
    same value: a GPU computes it with torch int64 reductions over the staged bytes (in
    pieces, kvshare.transfer.wsum), the host with numpy uint64 (below), bit for bit alike.
    What it catches: any change confined to one word (a flipped byte, a torn write of a
    word) changes the sum by (i + 1) * d with 0 < |d| < 2**32 and i + 1 < 2**32, a nonzero
    number below 2**64 in magnitude, so never 0 mod 2**64; likewise any swap of two words
    ((i - j) * (w_j - w_i)). Pages must hold a whole number of words and fewer than 2**32.

Unknown kinds are refused when a message is decoded (the protocol types the field).
"""

from __future__ import annotations

import enum

import numpy as np
import xxhash

MOD64 = 1 << 64
WSUM_BLOCK_WORDS = 1024  # words per row of the [rows, K] decomposition below (a power of two)


class ChecksumKind(enum.IntEnum):
    XXH3 = 1
    WSUM32 = 2


def page_checksum(data, kind: ChecksumKind = ChecksumKind.XXH3) -> int:
    """64-bit checksum of a bytes-like object (a numpy array or memoryview of a page), of ``kind``."""
    if kind == ChecksumKind.XXH3:
        return xxhash.xxh3_64_intdigest(data)
    if kind == ChecksumKind.WSUM32:
        return wsum32(data)
    raise ValueError(f"unknown checksum kind {kind!r}; known: {[k.name for k in ChecksumKind]}")


def block_words(num_words: int) -> int:
    """K: the largest power of two <= WSUM_BLOCK_WORDS dividing ``num_words`` (rows of K words)."""
    k = WSUM_BLOCK_WORDS
    while k > 1 and num_words % k:
        k //= 2
    return k


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
