"""CpuTransfer against a real pool: bytes stored are canonical, bytes loaded equal bytes stored."""

from __future__ import annotations

import random

import pytest
import torch

from kvshare.pool.checksum import page_checksum
from kvshare.pool.protocol import PageHeader
from kvshare.transfer import ChunkChecksumMismatch, TransferConfig, make_transfer
from kvshare.transfer.cpu import CpuTransfer
from kvshare.transfer.layouts import as_bits, torch_dtype
from kvshare.transfer.reference import page_bytes_of, reference_engine_to_pages
from kvshare.transfer.scratch import reserve_scratch
from tests.transfer.helpers import EXTENT_BYTES, LAYOUTS, bits_equal, random_kv


def headers(offsets, checksums, page_bytes):
    return [PageHeader(offset=o, page_bytes=page_bytes, checksum=c) for o, c in zip(offsets, checksums)]


def sentinel_kv(layout, num_tokens):
    kv = torch.empty(
        (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim), dtype=torch_dtype(layout.dtype)
    )
    as_bits(kv).fill_(0x5A)
    return kv


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("order", ["runs", "scattered"])
@pytest.mark.parametrize("first_chunk", [0, 3])
def test_store_then_load_is_byte_exact(client, name, order, first_chunk):
    layout = LAYOUTS[name]
    num_pages = 2 * EXTENT_BYTES // layout.page_bytes + 3  # spans at least two extent boundaries
    scratch = reserve_scratch(client, layout.page_bytes, num_pages)
    try:
        assert len(scratch.offsets) == num_pages
        offsets = list(scratch.offsets)
        if order == "scattered":
            random.Random(7).shuffle(offsets)
        capacity = (first_chunk + num_pages + 1) * layout.chunk_tokens
        src = random_kv(layout, capacity, seed=11)
        transfer = make_transfer(layout, client, "cpu", TransferConfig())
        assert isinstance(transfer, CpuTransfer)
        sums = transfer.store(src, first_chunk, offsets)

        # the pool holds canonical pages: compare with the slow reference for a few, and every checksum
        for i in (0, num_pages // 2, num_pages - 1):
            expected = page_bytes_of(reference_engine_to_pages(src, layout, first_chunk + i, 1))
            assert client.page(offsets[i], layout.page_bytes).tobytes() == expected, f"page {i} is not canonical"
        assert sums == [page_checksum(client.page(o, layout.page_bytes)) for o in offsets]

        dst = sentinel_kv(layout, capacity)
        handle = transfer.load(dst, first_chunk, headers(offsets, sums, layout.page_bytes))
        handle.wait_layer(0)
        handle.wait_all()
        assert handle.num_bytes == num_pages * layout.page_bytes and handle.seconds is not None
        t0, t1 = first_chunk * layout.chunk_tokens, (first_chunk + num_pages) * layout.chunk_tokens
        assert bits_equal(dst[:, :, :, t0:t1], src[:, :, :, t0:t1])
        untouched = sentinel_kv(layout, capacity)
        assert bits_equal(dst[:, :, :, :t0], untouched[:, :, :, :t0])
        assert bits_equal(dst[:, :, :, t1:], untouched[:, :, :, t1:])
    finally:
        scratch.release(client)


def test_checksum_mismatch_names_the_chunk(client):
    layout = LAYOUTS["bf16"]
    scratch = reserve_scratch(client, layout.page_bytes, 4)
    try:
        src = random_kv(layout, 6 * layout.chunk_tokens, seed=3)
        transfer = CpuTransfer(layout, client, torch.device("cpu"), TransferConfig(verify_fraction=1.0))
        sums = transfer.store(src, 2, scratch.offsets)
        view = client.page(scratch.offsets[1], layout.page_bytes)
        view[100] ^= 0xFF  # one flipped byte in the second page (chunk 3)
        with pytest.raises(ChunkChecksumMismatch) as info:
            transfer.load(
                sentinel_kv(layout, 6 * layout.chunk_tokens), 2, headers(scratch.offsets, sums, layout.page_bytes)
            )
        assert info.value.chunk_index == 3
        # without verification the corrupt page loads (the sampled default): this is what checksums are for
        unverified = CpuTransfer(layout, client, torch.device("cpu"), TransferConfig(verify_fraction=0.0))
        unverified.load(
            sentinel_kv(layout, 6 * layout.chunk_tokens), 2, headers(scratch.offsets, sums, layout.page_bytes)
        )
    finally:
        scratch.release(client)


def test_sampled_verification_checks_an_exact_share(client):
    layout = LAYOUTS["f32"]
    transfer = CpuTransfer(layout, client, torch.device("cpu"), TransferConfig(verify_fraction=0.25))
    assert sum(len(transfer._pages_to_verify(10)) for _ in range(4)) == 10


def test_bad_arguments_are_refused(client):
    layout = LAYOUTS["f32"]
    transfer = make_transfer(layout, client, "cpu")
    kv = random_kv(layout, 2 * layout.chunk_tokens, seed=0)
    with pytest.raises(ValueError, match="tokens"):
        transfer.store(kv, 1, [0, layout.page_bytes])  # chunks 1..2 need 48 tokens, kv holds 32
    with pytest.raises(ValueError, match="dtype"):
        transfer.store(kv.to(torch.float16), 0, [0])
    with pytest.raises(ValueError, match="holds"):
        transfer.load(kv, 0, [PageHeader(offset=0, page_bytes=layout.page_bytes * 2, checksum=0)])
    with pytest.raises(ValueError, match="device"):
        make_transfer(layout, client, "meta")
    with pytest.raises(ValueError, match="copy_method"):
        TransferConfig(copy_method="pageable")
    assert transfer.store(kv, 0, []) == []
