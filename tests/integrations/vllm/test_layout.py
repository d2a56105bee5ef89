"""vLLM paged KV layouts on CPU tensors: fast views against slow references and vLLM's own reads."""

import numpy as np
import pytest
import torch

from kvshare.integrations.vllm.block_copy import CpuBlockCopier
from kvshare.integrations.vllm.layout import (
    PagedLayout,
    UnsupportedKVLayout,
    detect_layout,
    gather_tokens,
    reference_gather,
    reference_scatter,
    scatter_tokens,
    slot_indices,
)

B, H, N, D = 12, 2, 32, 64


def cpu_attn_tensor():
    return torch.randn(B, H, N, 2 * D)


def flash_tensor(physical: str):
    """A [B, H, N, 2D] logical view whose memory order is ``physical`` (as vLLM's layouts make)."""
    if physical == "LBHNC":
        return torch.randn(B, H, N, 2 * D)
    if physical == "LBNHC":  # NHD: tokens outer, heads inner
        return torch.randn(B, N, H, 2 * D).permute(0, 2, 1, 3)
    if physical == "padded":  # blocks further apart than their size (another layer's page between)
        return torch.randn(B, 2, H, N, 2 * D)[:, 1]
    raise ValueError(physical)


CASES = [
    ("CPU_ATTN", cpu_attn_tensor),
    ("FLASH_ATTN", lambda: flash_tensor("LBHNC")),
    ("FLASH_ATTN", lambda: flash_tensor("LBNHC")),
    ("FLASH_ATTN", lambda: flash_tensor("padded")),
    ("FLASH_ATTN", lambda: torch.randn(2, B, N, H, D)),
]


def vllm_reads(backend, layer):
    """K and V as vLLM 0.32's attention backends read them, as [B, N, H, D] (copied from their forward)."""
    if backend == "CPU_ATTN":  # cpu_attn.py: kv_cache.view(B, H, 2N, -1).chunk(2, dim=2)
        key_cache, value_cache = layer.view(B, H, 2 * N, -1).chunk(2, dim=2)
        return key_cache.permute(0, 2, 1, 3), value_cache.permute(0, 2, 1, 3)
    if layer.dim() == 5:  # the older flash-attention layout: [2, B, N, H, D]
        return layer[0], layer[1]
    key_cache, value_cache = layer.transpose(1, 2).split(D, dim=-1)  # flash_attn.py
    return key_cache, value_cache


@pytest.mark.parametrize("backend,make", CASES)
def test_views_read_what_vllm_reads(backend, make):
    layer = make()
    layout = detect_layout(backend, layer, H, D, N, torch.float32)
    k, v = layout.kv_views(layer)
    k_ref, v_ref = vllm_reads(backend, layer)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("backend,make", CASES)
@pytest.mark.parametrize("token_start,num_tokens", [(0, 64), (32, 100), (45, 7), (0, 1)])
def test_scatter_and_gather_match_the_slow_reference(backend, make, token_start, num_tokens):
    torch.manual_seed(token_start + num_tokens)
    layer = make()
    layout = detect_layout(backend, layer, H, D, N, torch.float32)
    block_ids = torch.randperm(B).tolist()  # a shuffled block table
    kv = torch.randn(2, num_tokens, H, D)
    slots = slot_indices(token_start, num_tokens, block_ids, N, layer.device)

    expected = layer.clone()
    reference_scatter(expected, layout, kv, token_start, block_ids)
    scatter_tokens(layer, layout, kv, slots)
    assert torch.equal(layer, expected)  # same bytes written, nothing else touched

    assert torch.equal(reference_gather(layer, layout, token_start, num_tokens, block_ids), kv)
    out = torch.empty(2, num_tokens, H, D)
    gather_tokens(layer, layout, slots, out)
    assert torch.equal(out, kv)


def test_reference_catches_a_swapped_layout():
    """Negative control: reading CPU_ATTN memory with the flash-attention rule gives other bytes."""
    layer = cpu_attn_tensor()
    cpu = detect_layout("CPU_ATTN", layer, H, D, N, torch.float32)
    wrong = PagedLayout("flash_attn", B, N, H, D, torch.float32)
    kv = torch.randn(2, 64, H, D)
    slots = slot_indices(0, 64, list(range(B)), N, "cpu")
    scatter_tokens(layer, wrong, kv, slots)
    assert not torch.equal(reference_gather(layer, cpu, 0, 64, list(range(B))), kv)


def test_unknown_layouts_are_refused_by_name():
    with pytest.raises(UnsupportedKVLayout, match="FLASHINFER"):
        detect_layout("FLASHINFER", cpu_attn_tensor(), H, D, N, torch.float32)
    with pytest.raises(UnsupportedKVLayout, match="expected dtype"):
        detect_layout("CPU_ATTN", cpu_attn_tensor().half(), H, D, N, torch.float32)
    with pytest.raises(UnsupportedKVLayout, match="kv heads"):
        detect_layout("CPU_ATTN", torch.randn(B, 4, N, 2 * D), H, D, N, torch.float32)
    with pytest.raises(UnsupportedKVLayout, match="block size"):
        detect_layout("CPU_ATTN", torch.randn(B, H, 16, 2 * D), H, D, N, torch.float32)
    with pytest.raises(UnsupportedKVLayout, match="dense"):
        detect_layout("CPU_ATTN", flash_tensor("LBNHC"), H, D, N, torch.float32)
    with pytest.raises(UnsupportedKVLayout, match="innermost"):
        detect_layout("FLASH_ATTN", torch.randn(B, H, 2 * D, N).transpose(2, 3), H, D, N, torch.float32)
    with pytest.raises(UnsupportedKVLayout, match=r"\[2, blocks"):
        detect_layout("FLASH_ATTN", torch.randn(3, B, N, H, D), H, D, N, torch.float32)


def test_bytes_move_exactly_even_nan_payloads():
    layer = cpu_attn_tensor()
    layout = detect_layout("CPU_ATTN", layer, H, D, N, torch.float32)
    kv = torch.randn(2, 40, H, D)
    kv.view(torch.int32)[0, 3, 1, 5] = 0x7FA00001  # a signalling NaN with a payload
    slots = slot_indices(8, 40, list(range(B)), N, "cpu")
    scatter_tokens(layer, layout, kv, slots)
    out = torch.empty_like(kv)
    gather_tokens(layer, layout, slots, out)
    assert torch.equal(out.view(torch.int32), kv.view(torch.int32))


TABLES = {  # block tables of 6 blocks out of B = 12, as vLLM hands them out
    "ascending": [2, 3, 4, 5, 6, 7],  # a fresh server
    "descending": [11, 10, 9, 8, 7, 6],  # blocks freed in reverse by an earlier request
    "mixed": [7, 8, 3, 2, 11, 5],
}


@pytest.mark.parametrize("backend,make", CASES)
@pytest.mark.parametrize("table", sorted(TABLES))
@pytest.mark.parametrize("num_threads", [1, 2])
def test_block_copies_match_the_slow_reference(backend, make, table, num_threads):
    """The CPU load/store path: numpy whole-block copies, both ways, against element-by-element addressing."""
    torch.manual_seed(len(table) + num_threads)
    C, num_pages, num_layers = 2 * N, 3, 2  # pages of two blocks
    layers = [make() for _ in range(num_layers)]
    layout = detect_layout(backend, layers[0], H, D, N, torch.float32)
    block_ids = TABLES[table]
    pages = torch.randn(num_pages, num_layers, 2, C, H, D)  # canonical [n, L, 2, C, H, D]

    expected = [layer.clone() for layer in layers]
    for index, layer in enumerate(expected):
        tokens = pages[:, index].transpose(0, 1).reshape(2, num_pages * C, H, D)  # [2, T, H, D]
        reference_scatter(layer, layout, tokens, 0, block_ids)
    copier = CpuBlockCopier(layers, layout, num_threads)
    try:
        copier.to_blocks(pages.numpy().view(copier.dtype), 0, C, block_ids)
        for got, want in zip(layers, expected):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # those bytes, nothing else touched

        out = np.zeros(pages.shape, dtype=copier.dtype)
        copier.from_blocks(out, 0, C, block_ids)
        assert np.array_equal(out, pages.numpy().view(copier.dtype))

        # the second block of one page only (a load that starts inside a chunk)
        one = torch.randn(1, num_layers, 2, C, H, D)
        copier.to_blocks(one.numpy().view(copier.dtype), N, C, [block_ids[0]])
        got = reference_gather(layers[1], layout, 0, N, [block_ids[0]])
        assert torch.equal(got.view(torch.int32), one[0, 1, :, N:].contiguous().view(torch.int32))
    finally:
        copier.close()


def test_block_copies_refuse_what_is_not_whole_blocks():
    layer = cpu_attn_tensor()
    copier = CpuBlockCopier([layer], detect_layout("CPU_ATTN", layer, H, D, N, torch.float32))
    pages = np.zeros((1, 1, 2, 2 * N, H, D), dtype=copier.dtype)
    with pytest.raises(ValueError, match="not whole blocks"):
        copier.to_blocks(pages, 5, 2 * N, [0, 1])
    with pytest.raises(IndexError, match="outside the 12 blocks"):
        copier.to_blocks(pages, 0, 2 * N, [11, 12])
    with pytest.raises(IndexError, match="outside the 12 blocks"):
        copier.to_blocks(pages, 0, 2 * N, [0, -1])


@pytest.mark.parametrize("num_threads", [1, 3])
def test_copier_map_keeps_order_and_raises_a_helpers_error(num_threads):
    layer = cpu_attn_tensor()
    copier = CpuBlockCopier([layer], detect_layout("CPU_ATTN", layer, H, D, N, torch.float32), num_threads)
    try:
        assert copier.map(lambda x: x * x, list(range(10))) == [x * x for x in range(10)]
        assert copier.map(lambda x: x, []) == []
        with pytest.raises(ZeroDivisionError):
            copier.map(lambda x: 1 // x, [3, 0, 1, 2])  # item 1 is a helper's when num_threads > 1
    finally:
        copier.close()
