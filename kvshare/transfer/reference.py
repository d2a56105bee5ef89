"""Slow, obviously correct conversions: the oracle for ``layouts.py`` and the transfers.

Each one spells the index mapping out token by token and head by head, on CPU.
Test-sized inputs only.
"""

from __future__ import annotations

import torch

from kvshare.layout import KVLayout
from kvshare.transfer.layouts import as_bits


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
