"""Layouts and random KV shared by the transfer tests."""

from __future__ import annotations

import torch

from kvshare.layout import KVLayout
from kvshare.transfer.layouts import as_bits, torch_dtype

EXTENT_BYTES = 256 << 10

# page sizes: 8 KiB (32 per extent, so consecutive pages cross extents), 6 KiB (does not divide the extent), 16 KiB
LAYOUTS = {
    "f32": KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", chunk_tokens=16),
    "bf16": KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=8),
    "f16": KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", chunk_tokens=32),
}


def random_bits_(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill t with random bits (NaN and inf patterns included: copies must move bits, not values)."""
    bits = as_bits(t)
    info = torch.iinfo(bits.dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    bits.copy_(torch.randint(info.min, info.max, bits.shape, dtype=bits.dtype, generator=gen))
    return t


def random_kv(layout: KVLayout, num_tokens: int, seed: int, device="cpu") -> torch.Tensor:
    """kv [L, 2, H, T, D] of random bits."""
    shape = (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim)
    return random_bits_(torch.empty(shape, dtype=torch_dtype(layout.dtype), device=device), seed)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(as_bits(a).cpu(), as_bits(b).cpu())
