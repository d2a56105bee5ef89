"""vLLM-shaped paged KV tensors for tests, validation and the GPU harness (no vLLM needed).

vLLM 0.32 hands the connector one tensor per layer; on CUDA with flash attention its logical
shape is ``[blocks, kv_heads, block_size, 2 * head_dim]`` whatever the memory order, or the older
5-D ``[2, blocks, block_size, kv_heads, head_dim]``. ``paged_layers`` makes each memory order the
connector accepts (kvshare.integrations.vllm.layout):

    LBNHC    memory [B, N, H, 2D] (vLLM's NHD order), handed over as its [B, H, N, 2D] permutation
    LBHNC    memory [B, H, N, 2D]
    padded   blocks further apart than their size (another layer's block between each two)
    5d       [2, B, N, H, D]
    cpu_attn vLLM CPU's [B, H, N, 2D] (K rows then V rows per head)
"""

from __future__ import annotations

import torch

from kvshare.integrations.vllm.layout import PagedLayout, detect_layout

MEMORY_ORDERS = ("LBNHC", "LBHNC", "padded", "5d")  # the CUDA (flash attention) layouts
BACKENDS = {
    "LBNHC": "FLASH_ATTN",
    "LBHNC": "FLASH_ATTN",
    "padded": "FLASH_ATTN",
    "5d": "FLASH_ATTN",
    "cpu_attn": "CPU_ATTN",
}


def empty_layer(
    order: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """One layer's KV tensor in memory order ``order``, uninitialised."""
    B, N, H, D = num_blocks, block_size, num_kv_heads, head_dim
    if order == "LBNHC":
        return torch.empty(B, N, H, 2 * D, dtype=dtype, device=device).permute(0, 2, 1, 3)
    if order in ("LBHNC", "cpu_attn"):
        return torch.empty(B, H, N, 2 * D, dtype=dtype, device=device)
    if order == "padded":
        return torch.empty(B, 2, H, N, 2 * D, dtype=dtype, device=device)[:, 1]
    if order == "5d":
        return torch.empty(2, B, N, H, D, dtype=dtype, device=device)
    raise ValueError(f"unknown memory order {order!r}; known: {sorted(BACKENDS)}")


def paged_layers(
    order: str,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device,
) -> tuple[list[torch.Tensor], PagedLayout]:
    """``num_layers`` zeroed layer tensors and their layout, as the connector's ``register_kv_caches`` sees them."""
    layers = [
        empty_layer(order, num_blocks, block_size, num_kv_heads, head_dim, dtype, device).zero_()
        for _ in range(num_layers)
    ]
    return layers, detect_layout(BACKENDS[order], layers[0], num_kv_heads, head_dim, block_size, dtype)


def fill_random_(layer: torch.Tensor, seed: int) -> torch.Tensor:
    """Random bits into ``layer`` (NaN and inf patterns included: copies must move bits, not values)."""
    from kvshare.integrations.vllm.layout import as_bits

    bits = as_bits(layer)
    info = torch.iinfo(bits.dtype)
    gen = torch.Generator(device=layer.device).manual_seed(seed)
    bits.copy_(torch.randint(info.min, info.max, bits.shape, dtype=bits.dtype, device=layer.device, generator=gen))
    return layer
