"""Conversions between engines' KV layouts and the canonical page ``[L, 2, C, H, D]``.

For the vLLM connector: use ``gather_pages`` / ``scatter_pages`` (or ``gather`` /
``scatter`` for a token range that ends inside a block) with the per-layer
tensors vLLM hands to ``register_kv_caches`` and a request's block ids, and
``paged_layout_of`` to name the layout (it refuses shapes it does not know).
Each is checked against the slow, index-by-index versions in ``reference.py``.

Layouts (one tensor per layer for vLLM; B blocks of ``bs`` tokens)::

    engine      kv [L, 2, H, T, D]        the built-in engine's sequence KV (head-major)
    vllm_cpu    [B, H, bs, 2*D] reported, memory [B][H][K rows 0..bs-1, V rows 0..bs-1][D]
                (so: view(B, H, 2*bs, D); K = rows :bs; NOT [K|V] per token in the last dim)
    vllm_flash  [2, B, bs, H, D]          vLLM's CUDA flash-attention layout

Every copy runs on integer views of the same width (``as_bits``), so bytes move
exactly (NaN payloads included) whatever the KV dtype.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from kvshare.layout import KVLayout

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; known: {sorted(TORCH_DTYPES)}") from None


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an integer tensor of the same element width (same shape and strides)."""
    return t.view(_BITS[t.element_size()])


def bits_dtype(itemsize: int) -> torch.dtype:
    return _BITS[itemsize]


def chunks_view(buf: torch.Tensor, layout: "KVLayout", num_pages: int, num_layers: int | None = None) -> torch.Tensor:
    """The first bytes of a 1-D uint8 buffer as packed page rows [n, L', 2, C, H, D] (integer view, no copy).

    With ``num_layers`` = L' < L each row is a group of layers of a page, as a staging buffer holds them.
    """
    num_layers = layout.num_layers if num_layers is None else num_layers
    shape = (num_pages, num_layers, 2, layout.chunk_tokens, layout.num_kv_heads, layout.head_dim)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("chunks_view needs a contiguous 1-D uint8 buffer")
    return buf[: num_pages * num_layers * layout.layer_bytes].view(bits_dtype(layout.itemsize)).view(shape)


# -- built-in engine: kv [L, 2, H, T, D] <-> chunks [n, L, 2, C, H, D] --------------------------


def _engine_window(kv: torch.Tensor, chunks: torch.Tensor, first_token: int) -> torch.Tensor:
    if kv.dim() != 5 or chunks.dim() != 6:
        raise ValueError(f"expected kv [L, 2, H, T, D] and chunks [n, L, 2, C, H, D], got {tuple(kv.shape)}, {tuple(chunks.shape)}")
    n, num_layers, two, c, h, d = chunks.shape
    if (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != (num_layers, two, h, d):
        raise ValueError(f"kv {tuple(kv.shape)} does not match chunks {tuple(chunks.shape)}")
    if kv.dtype != chunks.dtype:
        raise ValueError(f"kv dtype {kv.dtype} != chunks dtype {chunks.dtype}")
    if first_token < 0 or first_token + n * c > kv.shape[3]:
        raise ValueError(f"tokens [{first_token}, {first_token + n * c}) exceed the kv capacity {kv.shape[3]}")
    return kv[:, :, :, first_token : first_token + n * c, :].unflatten(3, (n, c))  # [L, 2, H, n, C, D]


def chunks_to_engine(kv: torch.Tensor, chunks: torch.Tensor, first_token: int) -> None:
    """kv[:, :, :, first_token : first_token + n*C, :] <- chunks (the token/head transpose)."""
    _engine_window(kv, chunks, first_token).copy_(chunks.permute(1, 2, 4, 0, 3, 5))


def engine_to_chunks(chunks: torch.Tensor, kv: torch.Tensor, first_token: int) -> None:
    """chunks <- kv[:, :, :, first_token : first_token + n*C, :] in canonical order."""
    chunks.copy_(_engine_window(kv, chunks, first_token).permute(3, 0, 1, 4, 2, 5))


# -- vLLM paged layouts ---------------------------------------------------------------------------


class PagedLayout(str, Enum):
    VLLM_CPU = "vllm_cpu"
    VLLM_FLASH = "vllm_flash"


def kv_block_views(cache: torch.Tensor, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer's cache as views [num_blocks, block_size, H, D] (no copy)."""
    if layout is PagedLayout.VLLM_CPU:
        if cache.dim() != 4 or cache.shape[3] % 2:
            raise ValueError(f"vllm_cpu cache must be [blocks, kv_heads, block_size, 2*head_dim], got {tuple(cache.shape)}")
        if not cache.is_contiguous():
            raise ValueError("a vllm_cpu cache must be contiguous: its memory order is not the order its shape reports")
        b, h, bs, d2 = cache.shape
        rows = cache.view(b, h, 2 * bs, d2 // 2)  # [B, H, 2*bs, D]: K rows then V rows per (block, head)
        return rows[:, :, :bs].permute(0, 2, 1, 3), rows[:, :, bs:].permute(0, 2, 1, 3)
    if layout is PagedLayout.VLLM_FLASH:
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise ValueError(f"vllm_flash cache must be [2, blocks, block_size, kv_heads, head_dim], got {tuple(cache.shape)}")
        return cache[0], cache[1]
    raise ValueError(f"unknown paged layout {layout!r}")


def paged_layout_of(cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> PagedLayout:
    """Name the layout of a vLLM per-layer cache from its shape, or refuse it."""
    shape = tuple(cache.shape)
    if cache.dim() == 5 and shape[0] == 2 and shape[3:] == (num_kv_heads, head_dim):
        return PagedLayout.VLLM_FLASH
    if cache.dim() == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_dim:
        return PagedLayout.VLLM_CPU
    raise ValueError(
        f"unknown vLLM KV cache layout {shape} for {num_kv_heads} kv heads of dim {head_dim}; "
        "known: vllm_cpu [blocks, kv_heads, block_size, 2*head_dim], vllm_flash [2, blocks, block_size, kv_heads, head_dim]"
    )


def _block_index(block_ids, num_blocks: int, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.long).flatten()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise IndexError(f"block ids must lie in 0..{num_blocks - 1}, got {ids.tolist()}")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"block ids repeat: {ids.tolist()}")
    return ids.to(device)


def gather(
    caches: Sequence[torch.Tensor], block_ids, layout: PagedLayout, num_tokens: int | None = None
) -> torch.Tensor:
    """Tokens 0..num_tokens-1 of a block table as [L, 2, num_tokens, H, D] (the last block may be partial)."""
    k0, _ = kv_block_views(caches[0], layout)
    num_blocks, bs, h, d = k0.shape
    ids = _block_index(block_ids, num_blocks, k0.device)
    num_tokens = ids.numel() * bs if num_tokens is None else num_tokens
    if not (ids.numel() - 1) * bs < num_tokens <= ids.numel() * bs:
        raise ValueError(f"{num_tokens} tokens do not fill the last of {ids.numel()} blocks of {bs}")
    out = torch.empty((len(caches), 2, num_tokens, h, d), dtype=k0.dtype, device=k0.device)
    out_bits = as_bits(out)
    for layer, cache in enumerate(caches):
        for kv, view in enumerate(kv_block_views(cache, layout)):
            out_bits[layer, kv].copy_(as_bits(view)[ids].flatten(0, 1)[:num_tokens])
    return out


def scatter(canonical: torch.Tensor, caches: Sequence[torch.Tensor], block_ids, layout: PagedLayout) -> None:
    """Write canonical [L, 2, T, H, D] into tokens 0..T-1 of a block table (the last block may be partial)."""
    num_layers, two, num_tokens, h, d = canonical.shape
    k0, _ = kv_block_views(caches[0], layout)
    num_blocks, bs = k0.shape[:2]
    if (num_layers, two, h, d) != (len(caches), 2, k0.shape[2], k0.shape[3]) or canonical.dtype != k0.dtype:
        raise ValueError(f"canonical {tuple(canonical.shape)} {canonical.dtype} does not fit caches of {tuple(k0.shape)} {k0.dtype}")
    ids = _block_index(block_ids, num_blocks, k0.device)
    if not (ids.numel() - 1) * bs < num_tokens <= ids.numel() * bs:
        raise ValueError(f"{num_tokens} tokens do not fill the last of {ids.numel()} blocks of {bs}")
    full, rest = divmod(num_tokens, bs)
    src_bits = as_bits(canonical)
    for layer, cache in enumerate(caches):
        for kv, view in enumerate(kv_block_views(cache, layout)):
            dst, src = as_bits(view), src_bits[layer, kv]
            if full:
                dst[ids[:full]] = src[: full * bs].unflatten(0, (full, bs))
            if rest:
                dst[int(ids[full]), :rest].copy_(src[full * bs :])


def gather_pages(caches: Sequence[torch.Tensor], block_ids, layout: PagedLayout, chunk_tokens: int) -> torch.Tensor:
    """Whole chunks of a block table as canonical pages [n, L, 2, C, H, D] (contiguous)."""
    canonical = gather(caches, block_ids, layout)  # [L, 2, n*C, H, D]
    num_layers, _, num_tokens, h, d = canonical.shape
    _check_chunking(num_tokens, kv_block_views(caches[0], layout)[0].shape[1], chunk_tokens)
    n = num_tokens // chunk_tokens
    return canonical.view(num_layers, 2, n, chunk_tokens, h, d).permute(2, 0, 1, 3, 4, 5).contiguous()


def scatter_pages(pages: torch.Tensor, caches: Sequence[torch.Tensor], block_ids, layout: PagedLayout) -> None:
    """Write canonical pages [n, L, 2, C, H, D] into the blocks of whole chunks."""
    n, num_layers, _, c, h, d = pages.shape
    _check_chunking(n * c, kv_block_views(caches[0], layout)[0].shape[1], c)
    canonical = pages.permute(1, 2, 0, 3, 4, 5).reshape(num_layers, 2, n * c, h, d)
    scatter(canonical, caches, block_ids, layout)


def _check_chunking(num_tokens: int, block_size: int, chunk_tokens: int) -> None:
    if chunk_tokens % block_size:
        raise ValueError(f"chunk of {chunk_tokens} tokens is not a multiple of the block size {block_size}")
    if num_tokens % chunk_tokens:
        raise ValueError(f"{num_tokens} tokens are not whole chunks of {chunk_tokens}")
