"""The one verification point (kvshare.pool.checksum): what it says of a page, which pages it draws,
and that every load path of the built-in engine's transfers refuses a corrupt page through it.

Each path is run twice over a page with one flipped byte: as it is (the page is refused, and the spy
saw the check), and with the one check forced to say "valid" (the page is accepted). A path that
compared the checksum on its own would still refuse in the second run: that is the negative control.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvshare.pool.checksum import ChecksumKind, PageSampler, is_valid, page_checksum
from kvshare.pool.client import ChecksumMismatch, PoolClient
from kvshare.pool.protocol import PageHeader
from kvshare.transfer.base import ChunkChecksumMismatch, TransferConfig
from kvshare.transfer.cpu import CpuTransfer
from kvshare.transfer.cuda import CudaTransfer
from kvshare.transfer.scratch import reserve_scratch
from tests.transfer import fake_cuda
from tests.transfer.helpers import LAYOUTS, random_kv
from tests.verdicts import spy_verdicts

CPU = torch.device("cpu")
LAYOUT = LAYOUTS["bf16"]
NUM_PAGES = 3
BAD = 1  # the page whose byte is flipped


class Header:
    def __init__(self, checksum: int, kind: ChecksumKind) -> None:
        self.checksum, self.checksum_kind = checksum, kind


@pytest.mark.parametrize("kind", list(ChecksumKind))
def test_is_valid_takes_host_views_and_tensors_and_refuses_one_flipped_byte(kind):
    page = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    header = Header(page_checksum(page, kind), kind)
    as_bf16 = torch.from_numpy(page.copy()).view(torch.bfloat16).view(16, -1)  # a tensor page, its bytes in order
    assert is_valid(page, header) and is_valid(page.tobytes(), header) and is_valid(as_bf16, header)
    page[77] ^= 0x10
    as_bf16.view(torch.uint8).view(-1)[77] ^= 0x10
    assert not is_valid(page, header) and not is_valid(as_bf16, header)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.gpu
def test_is_valid_sums_a_gpu_page_on_the_gpu():
    page = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    header = Header(page_checksum(page, ChecksumKind.WSUM32), ChecksumKind.WSUM32)
    on_gpu = torch.from_numpy(page).cuda()
    assert is_valid(on_gpu, header)
    on_gpu[5] ^= 1
    assert not is_valid(on_gpu, header)


def test_the_sampler_checks_an_exact_share_all_or_none():
    sampler = PageSampler(0.25, random.Random(0))
    assert sum(len(sampler.choose(10)) for _ in range(4)) == 10
    assert PageSampler(1.0).choose(5) == [0, 1, 2, 3, 4] and PageSampler(0.0).choose(5) == []
    with pytest.raises(ValueError, match="verify_fraction must lie in"):
        PageSampler(1.5)


def test_the_sampler_leaves_no_position_unchecked():
    """Loads of two pages at a share of one half: each position is checked in some of them.

    Fails with a sampler that only counts credit (a page is drawn each time the credit reaches 1): it
    draws the second page of every such load and never the first.
    """
    sampler = PageSampler(0.5, random.Random(3))
    drawn = [sampler.choose(2) for _ in range(200)]
    assert sum(map(len, drawn)) == 200  # the share is exact
    assert sum(d == [0] for d in drawn) > 20 and sum(d == [1] for d in drawn) > 20


@pytest.fixture
def fake(monkeypatch):
    fake = fake_cuda.FakeCuda()
    fake_cuda.install(monkeypatch, fake)
    return fake


def corrupt_pages(client, writer) -> tuple[list[PageHeader], object]:
    """NUM_PAGES pages stored by ``writer`` (their checksums of its kind), page BAD with a flipped byte."""
    scratch = reserve_scratch(client, LAYOUT.page_bytes, NUM_PAGES)
    sums = writer.store(random_kv(LAYOUT, NUM_PAGES * LAYOUT.chunk_tokens, seed=4), 0, scratch.offsets)
    headers = [
        PageHeader(offset=o, page_bytes=LAYOUT.page_bytes, checksum=s, checksum_kind=writer.checksum_kind)
        for o, s in zip(scratch.offsets, sums)
    ]
    client.page(headers[BAD].offset, LAYOUT.page_bytes)[100] ^= 0x01
    return headers, scratch


def load_with(transfer, headers) -> None:
    """A load of the pages into a fresh kv; raises when a page is refused (before or beside the copies)."""
    kv = torch.zeros(
        (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, NUM_PAGES * LAYOUT.chunk_tokens, LAYOUT.head_dim),
        dtype=torch.bfloat16,
    )
    handle = transfer.load(kv, 0, headers)
    handle.wait_all()
    handle.verify()


LOAD_PATHS = {
    # name: (the writer's transfer class, the loader's)
    "cpu load": (CpuTransfer, CpuTransfer),
    "cuda load, WSUM32 summed over the staged bytes": (CudaTransfer, CudaTransfer),
    "cuda load, XXH3 page on the host threads": (CpuTransfer, CudaTransfer),
}


@pytest.mark.parametrize("path", sorted(LOAD_PATHS))
@pytest.mark.parametrize("forced", [None, True], ids=["checked", "forced-valid"])
def test_each_transfer_load_refuses_a_corrupt_page_through_the_one_check(fake, client, monkeypatch, path, forced):
    """Fails when a load path compares checksums itself: forced valid, it would still refuse the page."""
    writer_class, loader_class = LOAD_PATHS[path]
    config = TransferConfig(verify_fraction=1.0, min_copy_bytes=LAYOUT.layer_bytes, staging_bytes=4 << 10)
    with writer_class(LAYOUT, client, CPU, config) as writer, loader_class(LAYOUT, client, CPU, config) as loader:
        headers, scratch = corrupt_pages(client, writer)
        try:
            calls = spy_verdicts(monkeypatch, forced)
            if forced:
                load_with(loader, headers)  # the one check said valid: nothing else refuses the page
            else:
                with pytest.raises(ChunkChecksumMismatch) as info:
                    load_with(loader, headers)
                assert info.value.chunk_index == BAD
            assert headers[BAD].checksum in [recorded for recorded, _ in calls]
        finally:
            scratch.release(client)


@pytest.mark.parametrize("forced", [None, True], ids=["checked", "forced-valid"])
def test_read_checked_refuses_a_corrupt_page_through_the_one_check(pool_socket, monkeypatch, forced):
    """Fails when read_checked compares checksums itself: forced valid, it would still raise."""
    with (
        PoolClient(pool_socket, name="reader", verify_checksums=True) as client,
        CpuTransfer(LAYOUT, client, CPU, TransferConfig()) as writer,
    ):
        headers, scratch = corrupt_pages(client, writer)
        try:
            calls = spy_verdicts(monkeypatch, forced)
            if forced:
                client.read_checked(headers[BAD])
            else:
                with pytest.raises(ChecksumMismatch):
                    client.read_checked(headers[BAD])
            assert calls and calls[0][0] == headers[BAD].checksum
        finally:
            scratch.release(client)
