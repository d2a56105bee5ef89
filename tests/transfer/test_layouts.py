"""Fast layout conversions against the slow reference, for every layout kvshare supports."""

from __future__ import annotations

import pytest
import torch

from kvshare.layout import KVLayout
from kvshare.transfer.layouts import (
    PagedLayout,
    as_bits,
    chunks_to_engine,
    engine_to_chunks,
    gather,
    gather_pages,
    paged_layout_of,
    scatter,
    scatter_pages,
    torch_dtype,
)
from kvshare.transfer.reference import (
    reference_engine_to_pages,
    reference_gather,
    reference_pages_to_engine,
    reference_scatter,
)
from tests.transfer.helpers import bits_equal, random_bits_, random_kv

DTYPES = ["float32", "bfloat16", "float16"]
NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 9, 4, 2, 8, 3


def engine_layout(dtype):
    return KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, dtype=dtype, chunk_tokens=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_conversions_match_reference(dtype):
    layout = engine_layout(dtype)
    kv = random_kv(layout, 6 * layout.chunk_tokens, seed=1)
    pages = torch.empty((3, 2, 2, 8, 3, 4), dtype=torch_dtype(dtype))
    engine_to_chunks(pages, kv, first_token=2 * layout.chunk_tokens)
    assert bits_equal(pages, reference_engine_to_pages(kv, layout, first_chunk=2, num_chunks=3))

    fast, slow = torch.zeros_like(kv), torch.zeros_like(kv)
    chunks_to_engine(fast, pages, first_token=layout.chunk_tokens)
    reference_pages_to_engine(slow, pages, layout, first_chunk=1)
    assert bits_equal(fast, slow)


def test_engine_converter_without_transpose_is_caught():
    """Negative control: a converter that copies [H, T] as if it were [T, H] differs from the reference."""
    layout = engine_layout("float32")
    kv = random_kv(layout, 2 * layout.chunk_tokens, seed=2)
    broken = kv[:, :, :, : layout.chunk_tokens].reshape(1, 2, 2, 8, 3, 4)  # head-major bytes in a token-major page
    assert not bits_equal(broken, reference_engine_to_pages(kv, layout, 0, 1))


def make_caches(layout: PagedLayout, dtype: str, seed: int) -> list[torch.Tensor]:
    if layout is PagedLayout.VLLM_CPU:
        shape = (NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    else:
        shape = (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    return [random_bits_(torch.empty(shape, dtype=torch_dtype(dtype)), seed + i) for i in range(LAYERS)]


BLOCK_TABLES = [[7, 2, 5], [0, 1, 2], [8, 3, 6, 0]]


@pytest.mark.parametrize("layout", list(PagedLayout))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_ids", BLOCK_TABLES)
@pytest.mark.parametrize("partial", [0, 1, 3])
def test_paged_gather_and_scatter_match_reference(layout, dtype, block_ids, partial):
    num_tokens = len(block_ids) * BLOCK_SIZE - partial  # partial > 0: the last block is partly filled
    caches = make_caches(layout, dtype, seed=10)
    assert bits_equal(gather(caches, block_ids, layout, num_tokens), reference_gather(caches, block_ids, layout, num_tokens))

    canonical = random_bits_(torch.empty((LAYERS, 2, num_tokens, HEADS, HEAD_DIM), dtype=torch_dtype(dtype)), 99)
    fast = [c.clone() for c in caches]
    slow = [c.clone() for c in caches]
    scatter(canonical, fast, block_ids, layout)
    reference_scatter(canonical, slow, block_ids, layout)
    for f, s in zip(fast, slow):
        assert bits_equal(f, s)  # written rows equal, and every other row (other blocks, the tail) untouched
    assert bits_equal(gather(fast, block_ids, layout, num_tokens), canonical)


@pytest.mark.parametrize("layout", list(PagedLayout))
def test_pages_round_trip_through_a_block_table(layout):
    caches = make_caches(layout, "bfloat16", seed=20)
    block_ids = [4, 8, 1, 6]  # two chunks of 8 tokens = 2 blocks of 4 each
    pages = gather_pages(caches, block_ids, layout, chunk_tokens=8)
    assert pages.shape == (2, LAYERS, 2, 8, HEADS, HEAD_DIM) and pages.is_contiguous()
    expected = reference_gather(caches, block_ids, layout, 16).view(LAYERS, 2, 2, 8, HEADS, HEAD_DIM).permute(2, 0, 1, 3, 4, 5)
    assert bits_equal(pages, expected)
    other = make_caches(layout, "bfloat16", seed=30)
    scatter_pages(pages, other, [0, 2, 3, 5], layout)
    assert bits_equal(gather_pages(other, [0, 2, 3, 5], layout, 8), pages)


def test_vllm_cpu_read_as_kv_per_token_is_caught():
    """Negative control: reading the CPU cache's last dim as [K | V] per token (what its shape suggests) is wrong."""
    caches = make_caches(PagedLayout.VLLM_CPU, "float32", seed=40)
    block_ids = [3, 1]
    wrong_k = torch.stack([as_bits(c)[block_ids].permute(0, 2, 1, 3)[..., :HEAD_DIM].flatten(0, 1) for c in caches])
    right = reference_gather(caches, block_ids, PagedLayout.VLLM_CPU, 2 * BLOCK_SIZE)
    assert not torch.equal(wrong_k, right[:, 0])
    assert torch.equal(as_bits(gather(caches, block_ids, PagedLayout.VLLM_CPU))[:, 0], right[:, 0])


def test_layout_is_named_or_refused():
    assert paged_layout_of(torch.empty(5, 2, 16, 16), num_kv_heads=2, head_dim=8) is PagedLayout.VLLM_CPU
    assert paged_layout_of(torch.empty(2, 5, 16, 2, 8), num_kv_heads=2, head_dim=8) is PagedLayout.VLLM_FLASH
    with pytest.raises(ValueError, match="unknown vLLM KV cache layout"):
        paged_layout_of(torch.empty(5, 2, 16, 2, 8), num_kv_heads=2, head_dim=8)  # [blocks, 2, ...]: not known


def test_bad_block_tables_are_refused():
    caches = make_caches(PagedLayout.VLLM_FLASH, "float32", seed=50)
    with pytest.raises(ValueError, match="repeat"):
        gather(caches, [1, 1], PagedLayout.VLLM_FLASH)
    with pytest.raises(IndexError):
        gather(caches, [NUM_BLOCKS], PagedLayout.VLLM_FLASH)
    with pytest.raises(ValueError, match="do not fill"):
        gather(caches, [1, 2], PagedLayout.VLLM_FLASH, num_tokens=BLOCK_SIZE)  # the second block would be empty
    with pytest.raises(ValueError, match="multiple of the block size"):
        gather_pages(caches, [1, 2], PagedLayout.VLLM_FLASH, chunk_tokens=6)
    with pytest.raises(ValueError, match="contiguous"):
        cpu = make_caches(PagedLayout.VLLM_CPU, "float32", seed=51)
        gather([c.transpose(1, 2).contiguous().transpose(1, 2) for c in cpu], [0], PagedLayout.VLLM_CPU)
