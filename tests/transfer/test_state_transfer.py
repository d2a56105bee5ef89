"""A state checkpoint's page <-> the engine's live state buffer (kvshare.transfer.state), on CPU and under the fake
CUDA of fake_cuda.py: bytes loaded equal bytes stored, and a bad page (in the pool, or in the copy) is caught."""

from __future__ import annotations

import pytest
import torch

from kvshare.pool.checksum import ChecksumKind, page_checksum
from kvshare.pool.protocol import PageHeader
from kvshare.transfer import StateChecksumMismatch, TransferConfig, make_transfer
from kvshare.transfer.cuda import CudaTransfer
from kvshare.transfer.scratch import reserve_scratch
from tests.transfer import fake_cuda
from tests.transfer.helpers import LAYOUTS

CPU = torch.device("cpu")
STATE_BYTES = 24 << 10  # a checkpoint: whole 64-byte blocks, its own page size


@pytest.fixture
def fake(monkeypatch):
    fake = fake_cuda.FakeCuda()
    fake_cuda.install(monkeypatch, fake)
    return fake


def random_state(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (STATE_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def make(kind: str, client, **config):
    layout = LAYOUTS["f32"]
    if kind == "cuda":
        return CudaTransfer(layout, client, CPU, TransferConfig(**config))
    return make_transfer(layout, client, CPU, TransferConfig(**config))


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_bytes_loaded_equal_bytes_stored(request, client, kind):
    if kind == "cuda":
        request.getfixturevalue("fake")
    scratch = reserve_scratch(client, STATE_BYTES, 1)
    try:
        with make(kind, client, verify_fraction=1.0) as transfer:
            state = random_state(1)
            checksum = transfer.store_state(state, scratch.offsets[0])
            page_bytes = client.page(scratch.offsets[0], STATE_BYTES)
            assert torch.equal(torch.from_numpy(page_bytes.copy()), state)
            assert checksum == page_checksum(page_bytes, transfer.state_checksum_kind)
            header = PageHeader(
                offset=scratch.offsets[0],
                page_bytes=STATE_BYTES,
                checksum=checksum,
                checksum_kind=transfer.state_checksum_kind,
            )
            into = torch.zeros(STATE_BYTES, dtype=torch.uint8)
            load = transfer.load_state(header, into)
            load.wait(CPU)
            load.verify()
            assert torch.equal(into, state) and load.num_bytes == STATE_BYTES
    finally:
        scratch.release(client)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
@pytest.mark.parametrize("writer", [ChecksumKind.XXH3, ChecksumKind.WSUM32])
def test_a_corrupt_checkpoint_page_is_caught(request, client, kind, writer):
    """Either kind of page on either transfer: CPU refuses it before any byte moves, CUDA reports it in verify()."""
    if kind == "cuda":
        request.getfixturevalue("fake")
    scratch = reserve_scratch(client, STATE_BYTES, 1)
    try:
        with make(kind, client, verify_fraction=1.0) as transfer:
            offset = scratch.offsets[0]
            client.page(offset, STATE_BYTES)[:] = random_state(2).numpy()
            header = PageHeader(
                offset=offset,
                page_bytes=STATE_BYTES,
                checksum=page_checksum(client.page(offset, STATE_BYTES), writer),
                checksum_kind=writer,
            )
            client.page(offset, STATE_BYTES)[100] ^= 1  # the page changed after its commit
            into = torch.zeros(STATE_BYTES, dtype=torch.uint8)
            with pytest.raises(StateChecksumMismatch):
                transfer.load_state(header, into).verify()
            if kind == "cpu":
                assert not into.any()  # refused before the copy
    finally:
        scratch.release(client)


def test_a_byte_spoiled_in_the_cuda_copy_is_caught(fake, client, monkeypatch):
    """WSUM32 is summed over the bytes that landed in the state, so a bad copy is caught though the page is fine."""
    scratch = reserve_scratch(client, STATE_BYTES, 1)
    try:
        with make("cuda", client, verify_fraction=1.0) as transfer:
            offset = scratch.offsets[0]
            header = PageHeader(
                offset=offset,
                page_bytes=STATE_BYTES,
                checksum=transfer.store_state(random_state(3), offset),
                checksum_kind=ChecksumKind.WSUM32,
            )
            copy = fake.memcpy_2d

            def spoiling(dst, dpitch, src, spitch, width, height, kind, stream):
                result = copy(dst, dpitch, src, spitch, width, height, kind, stream)
                into.view(-1)[5] ^= 1  # the landed bytes differ from the page's
                return result

            into = torch.zeros(STATE_BYTES, dtype=torch.uint8)
            monkeypatch.setattr(fake, "memcpy_2d", spoiling)
            bindings = fake.runtime_module()
            bindings.cudaMemcpy2DAsync = spoiling
            monkeypatch.setattr(transfer.pipeline.copier, "_rt", bindings)
            with pytest.raises(StateChecksumMismatch):
                transfer.load_state(header, into).verify()
    finally:
        scratch.release(client)


def test_a_page_of_another_size_is_refused(client):
    with make("cpu", client) as transfer:
        header = PageHeader(offset=0, page_bytes=STATE_BYTES, checksum=0)
        with pytest.raises(ValueError, match="does not fit"):
            transfer.load_state(header, torch.zeros(STATE_BYTES - 64, dtype=torch.uint8))
