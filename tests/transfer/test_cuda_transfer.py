"""CudaTransfer on a real GPU: byte exactness at production shapes, ordering under delay, registration.

Skipped without CUDA. Run on the GPU machine with
``python3 -m pytest -q tests/transfer/test_cuda_transfer.py``.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.protocol import PageHeader
from kvshare.pool.spawn import running_pool
from kvshare.transfer import TransferConfig
from kvshare.transfer.bytecheck import run_bytecheck
from kvshare.transfer.cuda import CudaTransfer
from kvshare.transfer.layouts import as_bits
from kvshare.transfer.registration import RegistrationError, extent_pieces, register_range, unregister_range
from kvshare.transfer.roundtrip import ByteCheckConfig, random_kv, sentinel_kv
from kvshare.transfer.scratch import reserve_scratch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU_EXTENT = 64 << 20
# Qwen3-8B's per-layer shape (8 KV heads x 128, bf16, 256-token chunks: 1 MiB per layer) with 4 layers: 4 MiB pages
WIDE = KVLayout(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=256)
SMALL = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=32)


def cuda_methods() -> list[str]:
    try:
        import cuda.bindings.runtime  # noqa: F401

        return ["memcpy2d", "torch"]
    except ImportError:
        return ["torch"]


@pytest.fixture(scope="module")
def gpu_client():
    with running_pool("768MiB", ("--extent-size", str(GPU_EXTENT))) as socket_path:
        with PoolClient(socket_path, name="test-cuda-transfer") as client:
            yield client


def test_bytecheck_exact_and_controls_caught(gpu_client):
    report = run_bytecheck(gpu_client, ByteCheckConfig(layout=SMALL, copy_methods=tuple(cuda_methods())))
    print(report.table())
    assert report.ok, report.table()
    controls = [r for r in report.results if r.kind == "control"]
    assert len(controls) == 2 * len(cuda_methods()) and all(r.caught for r in controls)
    assert report.extent_boundaries >= 1


@pytest.mark.parametrize("method", cuda_methods())
@pytest.mark.parametrize("first_chunk", [0, 5])
@pytest.mark.parametrize("enqueue", ["thread", "lazy", "eager"])
def test_production_config_round_trip(gpu_client, method, first_chunk, enqueue):
    num_pages = 2 * GPU_EXTENT // WIDE.page_bytes + 5  # crosses two extent = registration boundaries
    scratch = reserve_scratch(gpu_client, WIDE.page_bytes, num_pages)
    try:
        half = num_pages // 2
        offsets = scratch.offsets[:half] + scratch.offsets[half:][::-1]  # long runs, then single pages
        with CudaTransfer(
            WIDE,
            gpu_client,
            torch.device("cuda"),
            TransferConfig(copy_method=method, verify_fraction=1.0, load_enqueue=enqueue),
        ) as transfer:
            capacity = (first_chunk + num_pages) * WIDE.chunk_tokens
            src = random_kv(WIDE, capacity, seed=first_chunk, device="cuda")
            sums = transfer.store(src, first_chunk, offsets)
            dst = sentinel_kv(WIDE, capacity, "cuda")
            headers = [PageHeader(offset=o, page_bytes=WIDE.page_bytes, checksum=s) for o, s in zip(offsets, sums)]
            handle = transfer.load(dst, first_chunk, headers)
            for layer in range(WIDE.num_layers):
                handle.wait_layer(layer)
            seen = dst.clone()
            handle.wait_all()
            t0 = first_chunk * WIDE.chunk_tokens
            assert torch.equal(as_bits(seen)[:, :, :, t0:], as_bits(src)[:, :, :, t0:])
            assert bool((as_bits(seen)[:, :, :, :t0].contiguous().view(torch.uint8) == 0x5A).all())
            assert handle.seconds is not None and handle.seconds > 0
    finally:
        scratch.release(gpu_client)


def test_registration_covers_each_extent_and_is_undone(gpu_client):
    transfer = CudaTransfer(SMALL, gpu_client, torch.device("cuda"), TransferConfig(copy_method="torch"))
    reg = transfer.registration
    assert reg.pieces == extent_pieces(gpu_client.arena.size, GPU_EXTENT)
    assert transfer.registration_seconds > 0
    with pytest.raises(RegistrationError):  # already registered: proves the piece is pinned
        register_range(reg.base_ptr, reg.pieces[0][1])
    transfer.close()
    register_range(reg.base_ptr, reg.pieces[0][1])  # unregistered by close(): registering again works
    unregister_range(reg.base_ptr)


def test_failed_registration_is_an_error():
    with pytest.raises(RegistrationError, match="cudaHostRegister"):
        register_range(0x1000, 4096)  # not mapped memory


# -- a hybrid model's state checkpoint (kvshare.transfer.state) ----------------------------------------------------


@pytest.mark.parametrize("method", cuda_methods())
def test_a_state_checkpoint_round_trips_and_the_compute_waits_for_it(method):
    """147 MiB (the 27B shape's checkpoint) to the pool and back; a reader on the compute stream that waits on the
    load sees every byte though the copy stream sleeps first, and one that does not wait sees stale bytes (the
    control: the dependency is what makes it right)."""
    state_bytes = 153_944_064
    with running_pool("1GiB", ("--extent-size", "256MiB"), quiet=True) as path, PoolClient(path) as client:
        scratch = reserve_scratch(client, state_bytes, 1)
        config = TransferConfig(copy_method=method, load_delay_cycles=2_000_000_000, verify_fraction=1.0)
        try:
            with CudaTransfer(SMALL, client, torch.device("cuda"), config) as transfer:
                state = torch.randint(0, 256, (state_bytes,), dtype=torch.uint8, device="cuda")
                checksum = transfer.store_state(state, scratch.offsets[0])
                header = PageHeader(
                    offset=scratch.offsets[0],
                    page_bytes=state_bytes,
                    checksum=checksum,
                    checksum_kind=transfer.state_checksum_kind,
                )
                into = torch.zeros_like(state)
                load = transfer.load_state(header, into)
                early = into[-4096:].clone()  # no wait: read while the copy stream sleeps
                load.wait(torch.device("cuda"))
                waited = into.clone()
                load.verify()
                assert torch.equal(waited, state)
                assert not torch.equal(early, state[-4096:])  # the control saw the bytes before they landed
        finally:
            scratch.release(client)
