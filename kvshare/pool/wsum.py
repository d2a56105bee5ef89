"""WSUM32 page checksums with torch: the GPU kernel behind kvshare.pool.checksum, equal to the host's ``wsum32``.

kvshare.pool.checksum defines the kind: ``sum_i (i + 1) * int32(word_i) mod 2**64`` over a page.
A GPU sees a page in pieces (the layer groups of a staging unit), so each piece is summed on
its own and added to its page's accumulator::

    piece of page p: words offset .. offset + W - 1          rows [n, W], one row per page
    contribution     sum_j (offset + j + 1) w_j  =  S1 + offset * S0
                     S1 = sum_j (j + 1) w_j,  S0 = sum_j w_j

int64 arithmetic wraps mod 2**64, so pieces add up in any order to the host's value. No
[n, W] temporary is made: S1 comes from row and column sums of the [n, M, K] words (the
identity in ``wsum32``'s docstring), two reductions that read the staged bytes once each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MOD64 = 1 << 64
WSUM_BLOCK_WORDS = 1024  # words per row of the [rows, K] decomposition (a power of two)


def block_words(num_words: int) -> int:
    """K: the largest power of two <= WSUM_BLOCK_WORDS dividing ``num_words`` (rows of K words)."""
    k = WSUM_BLOCK_WORDS
    while k > 1 and num_words % k:
        k //= 2
    return k


def add_rows(acc: torch.Tensor, rows: torch.Tensor, word_offset: int) -> None:
    """``acc[n]`` (int64) += the WSUM32 contribution of ``rows`` ``[n, W]`` (int32, words ``word_offset ..`` of
    each page).

    Enqueued on the current stream; nothing is read back.
    """
    import torch  # here, not above: kvshare.pool.checksum imports this module without torch

    if rows.dtype != torch.int32 or rows.dim() != 2 or rows.stride(-1) != 1:
        raise ValueError(f"rows must be [n, W] int32 with unit inner stride, got {rows.dtype} {tuple(rows.shape)}")
    n, num_words = rows.shape
    k = block_words(num_words)
    words = rows.view(n, num_words // k, k)  # [n, M, K]
    row_sums = words.sum(dim=2)  # [n, M] int64 (torch sums integers in int64): exact, |.| <= K * 2**31
    col_sums = words.sum(dim=1)  # [n, K] int64, |.| <= M * 2**31
    m_weights = torch.arange(words.shape[1], dtype=torch.int64, device=rows.device)
    k_weights = torch.arange(1, k + 1, dtype=torch.int64, device=rows.device)
    s1 = (row_sums * m_weights).sum(dim=1) * k + (col_sums * k_weights).sum(dim=1)
    s0 = row_sums.sum(dim=1)
    acc += s1 + s0 * word_offset


def add_head_rows(acc: torch.Tensor, words: torch.Tensor, row_offset: int, first_head: int, num_kv_heads: int) -> None:
    """``acc[n]`` (int64) += the WSUM32 terms of some heads of some rows of each page, their words given as
    ``[n, R, h, W]`` int32: rows ``row_offset ..`` of a page of ``num_kv_heads`` heads of W words each,
    heads ``first_head .. first_head + h - 1`` only (a tensor parallel rank's part of a page). Word
    ``(r, k, w)`` of the page has index ``i = (r * H + k) * W + w``, so::

        sum (i + 1) x = H W * sum_r r * rowsum_r + W * sum_k k * headsum_k + sum_w (w + 1) * colsum_w

    as ``tensor_parallel.partial_wsum32`` on the host. Two reductions read the words once each.
    Enqueued on the current stream; nothing is read back.
    """
    import torch  # here, not above: kvshare.pool.checksum imports this module without torch

    if words.dtype != torch.int32 or words.dim() != 4:
        raise ValueError(f"words must be [n, R, h, W] int32, got {words.dtype} {tuple(words.shape)}")
    n, num_rows, num_heads, num_words = words.shape
    by_row_head = words.sum(dim=3)  # [n, R, h] int64, |.| <= W * 2**31
    cols = words.sum(dim=(1, 2))  # [n, W] int64
    device = words.device
    row_ids = torch.arange(row_offset, row_offset + num_rows, dtype=torch.int64, device=device)
    head_ids = torch.arange(first_head, first_head + num_heads, dtype=torch.int64, device=device)
    col_weights = torch.arange(1, num_words + 1, dtype=torch.int64, device=device)
    by_row = (by_row_head.sum(dim=2) * row_ids).sum(dim=1)
    by_head = (by_row_head.sum(dim=1) * head_ids).sum(dim=1)
    acc += by_row * (num_kv_heads * num_words) + by_head * num_words + (cols * col_weights).sum(dim=1)


def page_sums(pages: torch.Tensor) -> torch.Tensor:
    """The WSUM32 of each of ``pages`` ``[n, ...]`` (any dtype; each page's bytes in memory order), as int64 ``[n]``."""
    import torch  # here, not above: kvshare.pool.checksum imports this module without torch

    rows = pages.reshape(pages.shape[0], -1).view(torch.uint8).view(torch.int32)
    acc = torch.zeros(pages.shape[0], dtype=torch.int64, device=pages.device)
    add_rows(acc, rows, 0)
    return acc


def as_unsigned(values: torch.Tensor) -> list[int]:
    """int64 sums (read back to the host) as the unsigned 64-bit values the pool records."""
    return [int(v) % MOD64 for v in values.cpu().tolist()]
