"""WSUM32 page checksums with torch: on the GPU over staged bytes, equal to the host's ``wsum32``.

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

import torch

from kvshare.pool.checksum import MOD64, block_words


def add_rows(acc: torch.Tensor, rows: torch.Tensor, word_offset: int) -> None:
    """``acc[n]`` (int64) += the WSUM32 contribution of ``rows`` ``[n, W]`` (int32, words ``word_offset ..`` of each page).

    Enqueued on the current stream; nothing is read back.
    """
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


def page_sums(pages: torch.Tensor) -> torch.Tensor:
    """The WSUM32 of each of ``pages`` ``[n, ...]`` (any dtype; each page's bytes in memory order), as int64 ``[n]``."""
    rows = pages.reshape(pages.shape[0], -1).view(torch.uint8).view(torch.int32)
    acc = torch.zeros(pages.shape[0], dtype=torch.int64, device=pages.device)
    add_rows(acc, rows, 0)
    return acc


def as_unsigned(values: torch.Tensor) -> list[int]:
    """int64 sums (read back to the host) as the unsigned 64-bit values the pool records."""
    return [int(v) % MOD64 for v in values.cpu().tolist()]
