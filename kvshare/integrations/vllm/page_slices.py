"""Which tokens of which leased pages a load copies into vLLM's blocks, and runs of pages one copy moves (pure).

A load of prompt tokens ``token_start .. token_end - 1`` from pages of ``C`` tokens (chunk ``c`` holds
positions ``c * C ..``) is a list of ``PageSlice`` (a page and its tokens ``lo .. hi - 1``); whole pages
that lie back to back in the arena merge into a ``CopyRun``. The CPU copies move runs; the GPU's staging
pipeline plans its own units (kvshare.transfer.plan) from the slices' pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare.integrations.vllm.metadata import LoadSpec
    from kvshare.layout import KVLayout


@dataclass(frozen=True)
class PageSlice:
    """Tokens ``lo .. hi - 1`` of page ``page_index`` (chunk ``chunk``), at prompt position ``chunk * C + lo``."""

    page_index: int
    chunk: int
    lo: int
    hi: int

    @property
    def num_tokens(self) -> int:
        return self.hi - self.lo


def page_slices(
    token_start: int, token_end: int, first_chunk: int, num_pages: int, chunk_tokens: int
) -> list[PageSlice]:
    """Which part of each leased page a load of tokens ``token_start .. token_end - 1`` copies::

    pages         |--- chunk 4 ---|--- chunk 5 ---|--- chunk 6 ---|
    load                  [start .................... end)
    slices               (0, 4, lo, C)  (1, 5, 0, C)  (2, 6, 0, hi)
    """
    if token_end <= token_start:
        return []
    first_page_start = first_chunk * chunk_tokens
    if token_start < first_page_start or token_end > (first_chunk + num_pages) * chunk_tokens:
        raise ValueError(
            f"tokens [{token_start}, {token_end}) are not inside the leased chunks "
            f"{first_chunk}..{first_chunk + num_pages - 1} of {chunk_tokens} tokens"
        )
    slices = []
    for index in range(num_pages):
        chunk = first_chunk + index
        lo = max(token_start - chunk * chunk_tokens, 0)
        hi = min(token_end - chunk * chunk_tokens, chunk_tokens)
        if hi > lo:
            slices.append(PageSlice(index, chunk, lo, hi))
    return slices


def load_pieces(spec: LoadSpec, kv_layout: KVLayout) -> tuple[list[PageSlice], str]:
    """The page slices a load may copy, and why it ends before the spec does ("" if it need not)."""
    C, page_bytes = kv_layout.chunk_tokens, kv_layout.page_bytes
    covered_end = min(spec.token_end, (spec.first_chunk + len(spec.pages)) * C)
    if spec.token_start < spec.first_chunk * C or covered_end <= spec.token_start:
        return [], "no leased page covers the load"
    pieces = page_slices(spec.token_start, covered_end, spec.first_chunk, len(spec.pages), C)
    for index, piece in enumerate(pieces):  # read no further than a page of another size: not this model's
        if spec.pages[piece.page_index].page_bytes != page_bytes:
            size = spec.pages[piece.page_index].page_bytes
            return pieces[:index], f"page of {size} bytes, this model's pages have {page_bytes}"
    return pieces, ""


@dataclass(frozen=True)
class CopyRun:
    """Pages ``first .. first + num_pages - 1`` of a load, adjacent in the arena, each copied at ``lo .. hi - 1``."""

    first: int  # index into the slices (and pages) of the load
    num_pages: int
    lo: int
    hi: int


def copy_runs(
    slices: list[PageSlice], offsets: list[int], page_bytes: int, chunk_tokens: int, extent_bytes: int = 0
) -> list[CopyRun]:
    """Group a load's page slices into runs that one strided copy per layer can move::

        slices   (0..C) (0..C) (0..C) (0..hi)      offsets  p, p+1, p+2, q
        runs     [--- one run of 3 pages ---] [one]

    Whole pages merge while they lie back to back in the arena (the pool allocates a
    request's pages as runs) inside one extent (``extent_bytes`` > 0): a copy that spans
    two CUDA registrations fails; a partial page is always a run of its own.
    """
    runs: list[CopyRun] = []
    for i, piece in enumerate(slices):
        whole = piece.lo == 0 and piece.hi == chunk_tokens
        if runs and whole:
            last = runs[-1]
            j = last.first + last.num_pages - 1
            adjacent = offsets[j] + page_bytes == offsets[i] and slices[j].chunk + 1 == piece.chunk
            if extent_bytes and offsets[last.first] // extent_bytes != (offsets[i] + page_bytes - 1) // extent_bytes:
                adjacent = False
            if last.lo == 0 and last.hi == chunk_tokens and adjacent:
                runs[-1] = CopyRun(last.first, last.num_pages + 1, 0, chunk_tokens)
                continue
        runs.append(CopyRun(i, 1, piece.lo, piece.hi))
    return runs


def blocks_of_tokens(token_start: int, token_end: int, block_size: int, block_ids: list[int]) -> list[int]:
    """vLLM block ids that hold tokens ``token_start .. token_end - 1`` (for reporting load errors)."""
    if token_end <= token_start:
        return []
    first, last = token_start // block_size, (token_end - 1) // block_size
    if last >= len(block_ids):
        raise ValueError(f"token {token_end - 1} lies in block {last}, but the request has {len(block_ids)} blocks")
    return list(block_ids[first : last + 1])
