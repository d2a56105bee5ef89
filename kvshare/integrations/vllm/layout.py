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

An fp8 cache (``--kv-cache-dtype fp8``) comes as uint8 tensors; copies move bits, so it is read as
is (``PagedLayout.dtype`` is the tensor's dtype, the pages' dtype is in the KVLayout).

Every kind is reduced to one strided view ``[2, B, N, H, D]`` (K|V, block, slot, kv head,
dim; no copy), so one indexing rule moves tokens for all of them; a canonical page is
``[L, 2, C, H, D]``. Two ways to move them:

- ``scatter_tokens`` / ``gather_tokens``: torch, any token positions, any device (the CUDA path);
- ``write_blocks`` / ``read_blocks``: numpy, whole blocks whose ids step by +1 or -1, CPU
  only: one strided copy per (layer, run of blocks), single-threaded (no OpenMP team to
  wait for) and callable from several threads at once, since numpy releases the GIL.

Each kind also has a slow reference that addresses raw storage element by element from
the description above, against which both are tested. Any other backend or shape is
refused with a message naming what was found.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvshare.transfer.layouts import as_bits  # integer views: copies move bytes exactly (NaN payloads too)

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

    def kv_blocks(self, layer: torch.Tensor) -> torch.Tensor:
        """A strided view ``[2, B, N, H, D]`` (K|V, block, slot, kv head, dim) of ``layer``."""
        B, N, H, D = self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        if self.kind == "cpu_attn":
            return layer.view(B, H, 2, N, D).permute(2, 0, 3, 1, 4)  # memory [B, H, K|V, N, D]
        if self.kind == "flash_attn":
            return layer.permute(0, 2, 1, 3).unflatten(-1, (2, D)).permute(3, 0, 1, 2, 4)  # [B, N, H, K|V, D]
        if self.kind == "flash_attn_5d":
            return layer  # [2, B, N, H, D] already
        raise UnsupportedKVLayout(f"unknown paged layout kind {self.kind!r}")

    def kv_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided views ``k, v`` of ``layer``, each ``[B, N, H, D]`` (block, slot, kv head, dim)."""
        kv = self.kv_blocks(layer)
        return kv[0], kv[1]


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
    # vLLM allocates an fp8 KV cache as uint8 (its STR_DTYPE_TO_TORCH_DTYPE): the same bytes
    fp8_as_bytes = tensor.dtype == torch.uint8 and dtype.itemsize == 1 and dtype.is_floating_point
    if tensor.dtype != dtype and not fp8_as_bytes:
        raise UnsupportedKVLayout(f"{where}: expected dtype {dtype} (the KV cache's dtype)")
    if backend_name == "FLASH_ATTN" and tensor.dim() == 5:
        if shape[0] != 2 or shape[2:] != (block_size, num_kv_heads, head_dim):
            raise UnsupportedKVLayout(f"{where}: expected [2, blocks, {block_size}, {num_kv_heads}, {head_dim}]")
        if tensor.stride(-1) != 1:
            raise UnsupportedKVLayout(f"{where}: head_dim is not the innermost axis (strides {tensor.stride()})")
        return PagedLayout("flash_attn_5d", shape[1], block_size, num_kv_heads, head_dim, dtype)
    if tensor.dim() != 4 or shape[1:] != (num_kv_heads, block_size, 2 * head_dim):
        raise UnsupportedKVLayout(
            f"{where}: expected [blocks, {num_kv_heads} kv heads, {block_size} block size, "
            f"{2 * head_dim} = 2 x head_dim]"
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


# -- whole blocks, numpy (CPU) ----------------------------------------------------------


def blocks_array(layer: torch.Tensor, layout: PagedLayout) -> np.ndarray:
    """``layout.kv_blocks(layer)`` as integers of the same width, ``[2, B, N, H, D]``, sharing its memory (CPU)."""
    return as_bits(layout.kv_blocks(layer)).numpy()


def split_axis(a: np.ndarray, axis: int, inner: int) -> np.ndarray:
    """``a`` with axis ``axis`` split into ``(size // inner, inner)``: always a view, never a copy."""
    size, stride = a.shape[axis], a.strides[axis]
    if size % inner:
        raise ValueError(f"axis {axis} of length {size} does not split into pieces of {inner}")
    shape = a.shape[:axis] + (size // inner, inner) + a.shape[axis + 1 :]
    strides = a.strides[:axis] + (stride * inner, stride) + a.strides[axis + 1 :]
    return np.lib.stride_tricks.as_strided(a, shape, strides, writeable=a.flags.writeable)


def _block_range(blocks: np.ndarray, first_block: int, num_pages: int, blocks_per_page: int, step: int) -> np.ndarray:
    """Blocks ``first_block, first_block + step, ...`` of ``blocks`` ``[2, B, N, H, D]`` as a view
    ``[2, num_pages, blocks_per_page, N, H, D]`` (a step of -1 is a negative stride: no copy)."""
    num_blocks = num_pages * blocks_per_page
    if step == 1:
        lo = first_block
    elif step == -1:
        lo = first_block - num_blocks + 1
    else:
        raise ValueError(f"block ids must step by +1 or -1, got {step}")
    if lo < 0 or lo + num_blocks > blocks.shape[1]:
        raise IndexError(f"blocks {lo}..{lo + num_blocks - 1} lie outside the {blocks.shape[1]} blocks of the layer")
    view = blocks[:, lo : lo + num_blocks]
    return split_axis(view if step == 1 else view[:, ::-1], 1, blocks_per_page)


def write_blocks(blocks: np.ndarray, kv: np.ndarray, first_block: int, step: int = 1) -> None:
    """Copy ``kv`` ``[2, P, b, N, H, D]`` (P pages of b whole blocks) into blocks
    ``first_block, first_block + step, ...`` of ``blocks`` (a ``blocks_array``), page by page."""
    np.copyto(_block_range(blocks, first_block, kv.shape[1], kv.shape[2], step), kv, casting="no")


def read_blocks(blocks: np.ndarray, first_block: int, step: int, out: np.ndarray) -> None:
    """Copy blocks ``first_block, first_block + step, ...`` of ``blocks`` into ``out`` ``[2, P, b, N, H, D]``."""
    np.copyto(out, _block_range(blocks, first_block, out.shape[1], out.shape[2], step), casting="no")


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
