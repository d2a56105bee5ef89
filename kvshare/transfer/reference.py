"""Slow, obviously correct conversions: the oracle for ``layouts.py`` and the transfers.

Each one spells the index mapping out token by token and head by head, on CPU,
and for vLLM's CPU layout works from the documented *memory* order (flat
offsets), not from the shape that tensor reports. Test-sized inputs only.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvshare.layout import KVLayout
from kvshare.transfer.layouts import PagedLayout, as_bits


def reference_engine_to_pages(kv: torch.Tensor, layout: KVLayout, first_chunk: int, num_chunks: int) -> torch.Tensor:
    """Pages [n, L, 2, C, H, D] (integer view) of chunks first_chunk.. of kv [L, 2, H, T, D]."""
    src = as_bits(kv).cpu()
    c = layout.chunk_tokens
    out = torch.empty((num_chunks, layout.num_layers, 2, c, layout.num_kv_heads, layout.head_dim), dtype=src.dtype)
    for i in range(num_chunks):
        for layer in range(layout.num_layers):
            for kv_index in range(2):
                for token in range(c):  # one [H, D] token row: the page is token-major, kv head-major
                    out[i, layer, kv_index, token, :, :] = src[layer, kv_index, :, (first_chunk + i) * c + token, :]
    return out


def reference_pages_to_engine(kv: torch.Tensor, pages: torch.Tensor, layout: KVLayout, first_chunk: int) -> None:
    """Write pages [n, L, 2, C, H, D] into kv [L, 2, H, T, D] (a CPU tensor) at chunks first_chunk.."""
    dst = as_bits(kv)
    src = pages.view(dst.dtype)  # pages in the KV dtype or its integer view
    c = layout.chunk_tokens
    for i in range(src.shape[0]):
        for layer in range(layout.num_layers):
            for kv_index in range(2):
                for token in range(c):
                    dst[layer, kv_index, :, (first_chunk + i) * c + token, :] = src[i, layer, kv_index, token, :, :]


def page_bytes_of(pages: torch.Tensor) -> bytes:
    """The bytes of canonical pages as they lie in the pool."""
    return pages.contiguous().view(torch.uint8).numpy().tobytes()


# -- vLLM paged layouts ----------------------------------------------------------------------------


def _dims(cache: torch.Tensor, layout: PagedLayout) -> tuple[int, int, int, int]:
    """(blocks, block_size, kv_heads, head_dim) from the shape the layout reports."""
    if layout is PagedLayout.VLLM_CPU:
        b, h, bs, d2 = cache.shape
        return b, bs, h, d2 // 2
    _, b, bs, h, d = cache.shape
    return b, bs, h, d


def _row_offset(layout: PagedLayout, kv: int, block: int, slot: int, head: int, dims) -> int:
    """Element offset of one [head_dim] row in the layer's flat memory."""
    num_blocks, bs, h, d = dims
    if layout is PagedLayout.VLLM_CPU:  # [block][head][K rows 0..bs-1, V rows 0..bs-1][head_dim]
        return ((block * h + head) * 2 * bs + kv * bs + slot) * d
    return (((kv * num_blocks + block) * bs + slot) * h + head) * d  # [k|v][block][slot][head][head_dim]


def reference_gather(caches: Sequence[torch.Tensor], block_ids: Sequence[int], layout: PagedLayout, num_tokens: int) -> torch.Tensor:
    """Tokens 0..num_tokens-1 of a block table as canonical [L, 2, T, H, D] (integer view)."""
    dims = _dims(caches[0], layout)
    _, bs, h, d = dims
    out = torch.empty((len(caches), 2, num_tokens, h, d), dtype=as_bits(caches[0]).dtype)
    for layer, cache in enumerate(caches):
        flat = as_bits(cache).cpu().contiguous().reshape(-1)
        for kv in range(2):
            for token in range(num_tokens):
                block, slot = block_ids[token // bs], token % bs
                for head in range(h):
                    start = _row_offset(layout, kv, block, slot, head, dims)
                    out[layer, kv, token, head, :] = flat[start : start + d]
    return out


def reference_scatter(canonical: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: Sequence[int], layout: PagedLayout) -> None:
    """Write canonical [L, 2, T, H, D] into contiguous CPU caches, row by row."""
    dims = _dims(caches[0], layout)
    _, bs, h, d = dims
    src = as_bits(canonical)
    for layer, cache in enumerate(caches):
        assert cache.is_contiguous() and cache.device.type == "cpu"
        flat = as_bits(cache).view(-1)
        for kv in range(2):
            for token in range(canonical.shape[2]):
                block, slot = block_ids[token // bs], token % bs
                for head in range(h):
                    start = _row_offset(layout, kv, block, slot, head, dims)
                    flat[start : start + d] = src[layer, kv, token, head, :]
