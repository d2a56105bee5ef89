"""vLLM's paged KV layouts (0.32) and copies between them and canonical pool pages.

vLLM 0.32 hands ``register_kv_caches`` one 4-D tensor per attention layer, logically
``[num_blocks, kv_heads, block_size, 2 * head_dim]``; what the bytes mean depends on
the attention backend that reads them:

``CPU_ATTN`` (vLLM CPU)
    memory ``[block][kv_head][K rows 0..N-1, then V rows 0..N-1][head_dim]``: the kernel
    views it as ``[B, H, 2N, D]`` and splits dim 2. The last dim is NOT [K|V] per token.
``FLASH_ATTN`` (CUDA)
    ``t.transpose(1, 2).split(D, -1)``: per token and head the last dim is ``[K (D) | V (D)]``;
    the physical order of the axes follows vLLM's resolved KV cache layout (any strides).
``FLASH_ATTN`` with a 5-D tensor (vLLM before the per-layer [B, H, N, C] views)
    ``[2, num_blocks, block_size, kv_heads, head_dim]``: K is ``t[0]``, V is ``t[1]``.

Every kind is reduced to two strided views ``k, v`` of shape ``[B, N, H, D]`` (no copy),
so one indexing rule moves tokens for all of them; a canonical page is
``[L, 2, C, H, D]``. Each kind also has a slow reference that addresses raw storage
element by element from the description above, against which the fast path is tested.
Any other backend or shape is refused with a message naming what was found.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KNOWN_BACKENDS = ("CPU_ATTN", "FLASH_ATTN")


class UnsupportedKVLayout(ValueError):
    """vLLM gave KV tensors in a layout kvshare does not know how to read."""


@dataclass(frozen=True)
class PagedLayout:
    """How one vLLM layer tensor stores K and V of ``block_size`` tokens per block."""

    kind: str  # "cpu_attn" | "flash_attn" | "flash_attn_5d"
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def kv_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views ``k, v`` of ``layer``, each ``[B, N, H, D]`` (block, slot, kv head, dim)."""
        B, N, H, D = self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        if self.kind == "cpu_attn":
            split = layer.view(B, H, 2, N, D)  # [B, H, K|V, N, D]
            return split[:, :, 0].permute(0, 2, 1, 3), split[:, :, 1].permute(0, 2, 1, 3)
        if self.kind == "flash_attn":
            tokens = layer.permute(0, 2, 1, 3)  # [B, N, H, 2D]
            return tokens[..., :D], tokens[..., D:]
        if self.kind == "flash_attn_5d":
            return layer[0], layer[1]  # [B, N, H, D] each
        raise UnsupportedKVLayout(f"unknown paged layout kind {self.kind!r}")


def detect_layout(
    backend_name: str, tensor: torch.Tensor, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> PagedLayout:
    """The layout of one layer's KV tensor, or UnsupportedKVLayout saying what does not fit."""
    shape = tuple(tensor.shape)
    where = f"vLLM attention backend {backend_name!r}, KV tensor of shape {shape}, dtype {tensor.dtype}"
    if backend_name not in KNOWN_BACKENDS:
        raise UnsupportedKVLayout(
            f"kvshare cannot read the KV cache of {where}: it knows {', '.join(KNOWN_BACKENDS)} "
            "(vLLM CPU and CUDA flash attention); choose one of those backends or run without the connector"
        )
    if tensor.dtype != dtype:
        raise UnsupportedKVLayout(f"{where}: expected dtype {dtype} (the model's KV dtype)")
    if backend_name == "FLASH_ATTN" and tensor.dim() == 5:
        if shape[0] != 2 or shape[2:] != (block_size, num_kv_heads, head_dim):
            raise UnsupportedKVLayout(f"{where}: expected [2, blocks, {block_size}, {num_kv_heads}, {head_dim}]")
        if tensor.stride(-1) != 1:
            raise UnsupportedKVLayout(f"{where}: head_dim is not the innermost axis (strides {tensor.stride()})")
        return PagedLayout("flash_attn_5d", shape[1], block_size, num_kv_heads, head_dim, dtype)
    if tensor.dim() != 4 or shape[1:] != (num_kv_heads, block_size, 2 * head_dim):
        raise UnsupportedKVLayout(
            f"{where}: expected [blocks, {num_kv_heads} kv heads, {block_size} block size, {2 * head_dim} = 2 x head_dim]"
        )
    if backend_name == "CPU_ATTN":
        # the kernel's .view(B, H, 2N, D) needs each block's [H, N, 2D] to be dense
        B, H, N, C = shape
        if tensor.stride()[1:] != (N * C, C, 1):
            raise UnsupportedKVLayout(f"{where}: a block is not dense [H, N, 2D] (strides {tensor.stride()})")
        return PagedLayout("cpu_attn", B, block_size, num_kv_heads, head_dim, dtype)
    if tensor.stride(-1) != 1:
        raise UnsupportedKVLayout(f"{where}: [K|V] is not the innermost axis (strides {tensor.stride()})")
    return PagedLayout("flash_attn", shape[0], block_size, num_kv_heads, head_dim, dtype)


def slot_indices(token_start: int, num_tokens: int, block_ids, block_size: int, device) -> tuple:
    """(block index, slot in block) tensors of prompt positions ``token_start .. token_start + num_tokens - 1``."""
    return slots_of_positions(torch.arange(token_start, token_start + num_tokens), block_ids, block_size, device)


def slots_of_positions(positions: torch.Tensor, block_ids, block_size: int, device) -> tuple:
    """(block index, slot in block) tensors, shaped like ``positions`` (prompt token positions)."""
    table = torch.as_tensor(block_ids, dtype=torch.long)
    return table[positions // block_size].to(device), (positions % block_size).to(device)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same width: copies move bytes exactly (NaN payloads too)."""
    return t.view(_BITS[t.element_size()])


def scatter_tokens(layer: torch.Tensor, layout: PagedLayout, kv: torch.Tensor, slots: tuple) -> None:
    """Write ``kv`` ``[2, *S, H, D]`` (K and V of tokens) into ``layer`` at ``slots`` (block, offset; shape S)."""
    k_view, v_view = layout.kv_views(as_bits(layer))
    kv = as_bits(kv)
    blocks, offsets = slots
    k_view[blocks, offsets] = kv[0]
    v_view[blocks, offsets] = kv[1]


def gather_tokens(layer: torch.Tensor, layout: PagedLayout, slots: tuple, out: torch.Tensor) -> None:
    """Copy K and V of the tokens at ``slots`` (shape S) from ``layer`` into ``out`` ``[2, *S, H, D]``."""
    k_view, v_view = layout.kv_views(as_bits(layer))
    out = as_bits(out)
    blocks, offsets = slots
    out[0].copy_(k_view[blocks, offsets])
    out[1].copy_(v_view[blocks, offsets])


# -- slow references: element addressing straight from the layout descriptions ----------


def _element_index(layout: PagedLayout, layer: torch.Tensor, kv: int, block: int, slot: int, head: int, d: int) -> int:
    """Flat storage index of K (kv=0) or V (kv=1) element ``d`` of (block, slot, head)."""
    s = layer.stride()
    base = layer.storage_offset()
    N, D = layout.block_size, layout.head_dim
    if layout.kind == "cpu_attn":
        # [block][kv_head][K rows 0..N-1, then V rows 0..N-1][head_dim]
        return base + block * s[0] + head * s[1] + (kv * N + slot) * D + d
    if layout.kind == "flash_attn":
        # logical [block, kv_head, slot, K (D) | V (D)]
        return base + block * s[0] + head * s[1] + slot * s[2] + (kv * D + d) * s[3]
    if layout.kind == "flash_attn_5d":
        return base + kv * s[0] + block * s[1] + slot * s[2] + head * s[3] + d * s[4]
    raise UnsupportedKVLayout(f"unknown paged layout kind {layout.kind!r}")


def _reference_rows(layer, layout, token_start: int, num_tokens: int, block_ids):
    """(k|v, token, head, strided view of that row's D elements in the flat storage), one at a time."""
    flat = torch.as_strided(layer, (layer.untyped_storage().nbytes() // layer.element_size(),), (1,), 0)
    D = layout.head_dim
    for t in range(num_tokens):
        pos = token_start + t
        block, slot = block_ids[pos // layout.block_size], pos % layout.block_size
        for which in (0, 1):
            for h in range(layout.num_kv_heads):
                start = _element_index(layout, layer, which, block, slot, h, 0)
                step = _element_index(layout, layer, which, block, slot, h, 1) - start if D > 1 else 1
                yield which, t, h, flat[start : start + step * (D - 1) + 1 : step]


def reference_scatter(layer, layout, kv, token_start, block_ids) -> None:
    """Slow scatter_tokens: one row at a time through the flat storage (tests only)."""
    for which, t, h, row in _reference_rows(layer, layout, token_start, kv.shape[1], block_ids):
        row.copy_(kv[which, t, h])


def reference_gather(layer, layout, token_start, num_tokens, block_ids) -> torch.Tensor:
    """Slow gather_tokens: returns ``[2, T, H, D]`` read one row at a time from the flat storage (tests only)."""
    out = torch.empty(2, num_tokens, layout.num_kv_heads, layout.head_dim, dtype=layer.dtype)
    for which, t, h, row in _reference_rows(layer, layout, token_start, num_tokens, block_ids):
        out[which, t, h] = row
    return out
