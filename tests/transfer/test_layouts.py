"""The built-in engine's layout conversions against the slow reference (vLLM's: tests/integrations)."""

from __future__ import annotations

import pytest
import torch

from kvshare.layout import KVLayout
from kvshare.transfer.layouts import chunks_to_engine, engine_to_chunks, torch_dtype
from kvshare.transfer.reference import reference_engine_to_pages, reference_pages_to_engine
from tests.transfer.helpers import bits_equal, random_kv

DTYPES = ["float32", "bfloat16", "float16"]


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
