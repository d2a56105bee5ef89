"""CudaTransfer's data path on CPU, under the fake CUDA of fake_cuda.py (no stream ordering here).

Real pages from a real pool, real 2-D row copies (memmove) with the pitches and
pointers CudaTransfer computes, registration pieces checked on every copy.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from kvshare.pool.protocol import PageHeader
from kvshare.transfer import ChunkChecksumMismatch, TransferConfig
from kvshare.transfer.bytecheck import make_cases, stress_config
from kvshare.transfer.copiers import CopyError
from kvshare.transfer.cuda import CudaTransfer
from kvshare.transfer.ordercheck import load_order, store_order
from kvshare.transfer.registration import RegistrationError, extent_pieces
from kvshare.transfer.roundtrip import ByteCheckConfig, round_trip
from kvshare.transfer.scratch import reserve_scratch
from tests.transfer import fake_cuda
from tests.transfer.helpers import EXTENT_BYTES, LAYOUTS, random_kv

CPU = torch.device("cpu")


@pytest.fixture
def fake(monkeypatch):
    fake = fake_cuda.FakeCuda()
    fake_cuda.install(monkeypatch, fake)
    return fake


def stored_pages(transfer, layout, offsets, seed):
    """Random KV of len(offsets) chunks stored into these pages; (the KV, the pages' headers)."""
    data = random_kv(layout, len(offsets) * layout.chunk_tokens, seed=seed)
    sums = transfer.store(data, 0, offsets)
    return data, [PageHeader(offset=o, page_bytes=layout.page_bytes, checksum=s) for o, s in zip(offsets, sums)]


@pytest.mark.parametrize("method", ["memcpy2d", "torch"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("stress", [True, False])
@pytest.mark.parametrize("enqueue", ["thread", "lazy", "eager"])
def test_round_trip_through_staging(fake, client, method, name, stress, enqueue):
    layout = LAYOUTS[name]
    scratch = reserve_scratch(client, layout.page_bytes, 2 * EXTENT_BYTES // layout.page_bytes + 3)
    try:
        base = stress_config(layout) if stress else TransferConfig(staging_bytes=1 << 20)
        config = TransferConfig(**{**base.__dict__, "copy_method": method, "load_enqueue": enqueue})
        transfer = CudaTransfer(layout, client, CPU, config)
        assert sorted(fake.registered) == [
            transfer.registration.base_ptr + o for o, _ in extent_pieces(client.arena.size, EXTENT_BYTES)
        ]
        cases = make_cases(scratch.offsets, EXTENT_BYTES, seed=1)
        checked, wrong = round_trip(transfer, client, cases, ByteCheckConfig(layout=layout), CPU)
        assert checked > 0 and wrong == 0
        if method == "memcpy2d":
            assert max(h for _, h in fake.copies_2d) > 1  # whole runs moved in single copies
        transfer.close()
        assert fake.registered == {}
    finally:
        scratch.release(client)


@pytest.mark.parametrize("buffers", [3, 4])
def test_round_trip_through_more_staging_buffers(fake, client, buffers):
    layout = LAYOUTS["bf16"]
    scratch = reserve_scratch(client, layout.page_bytes, 2 * EXTENT_BYTES // layout.page_bytes + 3)
    try:
        config = dataclasses.replace(stress_config(layout), staging_buffers=buffers)
        with CudaTransfer(layout, client, CPU, config) as transfer:
            stages = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in transfer.pipeline.load_lane.buffers]
            assert len(stages) == buffers
            checked, wrong = round_trip(
                transfer, client, make_cases(scratch.offsets, EXTENT_BYTES, seed=2), ByteCheckConfig(layout=layout), CPU
            )
            assert checked > 0 and wrong == 0
            used = {i for ptr in fake.device_ends for i, (lo, hi) in enumerate(stages) if lo <= ptr < hi}
            assert used == set(range(buffers))  # the units rotate through every buffer
    finally:
        scratch.release(client)


def test_one_staging_buffer_is_refused():
    with pytest.raises(ValueError, match="staging_buffers must be >= 2"):
        TransferConfig(staging_buffers=1)


def test_ordering_checks_move_the_right_bytes_when_ordered(fake, client):
    layout = LAYOUTS["bf16"]
    scratch = reserve_scratch(client, layout.page_bytes, 5)
    try:
        config = TransferConfig(producer_delay_cycles=10, load_delay_cycles=10)
        with CudaTransfer(layout, client, CPU, config) as transfer:
            checked, wrong = store_order(transfer, client, scratch.offsets, seed=3)
            assert checked == 5 * layout.page_bytes and wrong == 0
            data = random_kv(layout, 5 * layout.chunk_tokens, seed=4)
            sums = transfer.store(data, 0, scratch.offsets)
            checked, wrong = load_order(transfer, scratch.offsets, sums, data, wait=True)
            assert checked > 0 and wrong == 0
    finally:
        scratch.release(client)


def test_registration_failure_is_an_error_and_undone(fake, client):
    fake.fail_register_at = 3
    with pytest.raises(RegistrationError, match="cudaHostRegister.*fake error 1"):
        CudaTransfer(LAYOUTS["f32"], client, CPU, TransferConfig())
    assert fake.registered == {}  # the pieces registered before the failure were unregistered


def test_registration_is_shared_and_released_by_the_last_user(fake, client):
    first = CudaTransfer(LAYOUTS["f32"], client, CPU, TransferConfig(copy_method="torch"))
    second = CudaTransfer(LAYOUTS["bf16"], client, CPU, TransferConfig(copy_method="torch"))
    assert first.registration is second.registration and fake.register_calls == len(
        extent_pieces(client.arena.size, EXTENT_BYTES)
    )
    first.close()
    assert fake.registered
    second.close()
    assert fake.registered == {}


def test_closing_the_client_drops_the_pins_of_its_arena_even_while_a_transfer_holds_them(fake, pool_socket):
    """A transfer never closed, its client closed (the arena unmapped): the pins go with the mapping, so a
    new arena mapped at the same address registers cleanly (before: CUDA error 712, "already mapped", on
    the H200 when the engine GPU test left an engine unclosed before the transfer tests)."""
    from kvshare.pool.client import PoolClient

    first = PoolClient(pool_socket).connect()
    leaked = CudaTransfer(LAYOUTS["f32"], first, CPU, TransferConfig(copy_method="torch"))  # never closed
    assert fake.registered
    first.close()
    assert fake.registered == {} and leaked.registration.is_forgotten
    leaked.close()  # a late release changes nothing
    with PoolClient(pool_socket) as second:
        with CudaTransfer(LAYOUTS["f32"], second, CPU, TransferConfig(copy_method="torch")) as transfer:
            assert not transfer.registration.is_forgotten and fake.registered
    assert fake.registered == {}


def test_a_client_dropped_without_close_drops_the_pins_of_its_arena(fake, pool_socket):
    """The engines of a test never closed: their clients are collected later and their arenas unmapped as the
    mmaps go; the pins must go before (seen on the H200: CUDA error 712 in the next test's registration)."""
    import gc

    from kvshare.pool.client import PoolClient

    client = PoolClient(pool_socket).connect()
    transfer = CudaTransfer(LAYOUTS["f32"], client, CPU, TransferConfig(copy_method="torch"))
    registration = transfer.registration
    assert fake.registered
    del client, transfer
    gc.collect()
    assert fake.registered == {} and registration.is_forgotten


def test_a_copy_across_two_registrations_is_refused(fake, client):
    layout = LAYOUTS["f32"]
    with CudaTransfer(layout, client, CPU, TransferConfig()) as transfer:
        with pytest.raises(RegistrationError, match="span two CUDA registrations"):
            transfer.registration.check_span(EXTENT_BYTES - layout.page_bytes, 2 * layout.page_bytes)


def test_memcpy2d_without_cuda_bindings_fails_loudly(monkeypatch, client):
    fake = fake_cuda.FakeCuda()
    fake_cuda.install(monkeypatch, fake, with_bindings=False)
    with pytest.raises(CopyError, match="cuda-bindings"):
        CudaTransfer(LAYOUTS["f32"], client, CPU, TransferConfig(copy_method="memcpy2d"))
    assert fake.registered == {}  # refused before anything was pinned
    CudaTransfer(LAYOUTS["f32"], client, CPU, TransferConfig(copy_method="torch")).close()


@pytest.mark.parametrize("writer", ["gpu", "cpu"])
def test_a_corrupt_page_is_reported_after_the_copies(fake, client, writer):
    """The store records WSUM32 summed over the staged bytes; a load checks each page by its recorded kind
    (WSUM32 from the staged bytes, XXH3 on host threads) beside the copies and reports a bad page in verify()."""
    from kvshare.pool.checksum import ChecksumKind, page_checksum

    layout = LAYOUTS["f16"]
    scratch = reserve_scratch(client, layout.page_bytes, 3)
    try:
        with CudaTransfer(layout, client, CPU, TransferConfig(verify_fraction=1.0)) as transfer:
            assert transfer.checksum_kind == ChecksumKind.WSUM32
            kv = random_kv(layout, 4 * layout.chunk_tokens, seed=5)
            sums = transfer.store(kv, 1, scratch.offsets)
            assert sums == [
                page_checksum(client.page(o, layout.page_bytes), ChecksumKind.WSUM32) for o in scratch.offsets
            ]
            kind = ChecksumKind.WSUM32 if writer == "gpu" else ChecksumKind.XXH3
            if writer == "cpu":  # as a CPU replica would have committed the same pages
                sums = [page_checksum(client.page(o, layout.page_bytes)) for o in scratch.offsets]
            headers = [
                PageHeader(offset=o, page_bytes=layout.page_bytes, checksum=s, checksum_kind=kind)
                for o, s in zip(scratch.offsets, sums)
            ]
            handle = transfer.load(torch.zeros_like(kv), 1, headers)
            assert handle.check.needs_staged_sums == (writer == "gpu")
            handle.verify()  # all good
            client.page(scratch.offsets[2], layout.page_bytes)[7] ^= 1
            handle = transfer.load(torch.zeros_like(kv), 1, headers)  # returns: nothing checked on the way
            with pytest.raises(ChunkChecksumMismatch) as info:
                handle.verify()
            assert info.value.chunk_index == 3
    finally:
        scratch.release(client)


def test_a_byte_spoiled_in_the_staging_copy_is_caught(fake, client, monkeypatch):
    """WSUM32 covers the bytes that reached the staging buffer: a bad copy is caught though the page is fine."""
    layout = LAYOUTS["bf16"]
    scratch = reserve_scratch(client, layout.page_bytes, 2)
    try:
        with CudaTransfer(layout, client, CPU, TransferConfig(verify_fraction=1.0, copy_method="torch")) as transfer:
            kv = random_kv(layout, 2 * layout.chunk_tokens, seed=8)
            sums = transfer.store(kv, 0, scratch.offsets)
            headers = [
                PageHeader(offset=o, page_bytes=layout.page_bytes, checksum=s, checksum_kind=transfer.checksum_kind)
                for o, s in zip(scratch.offsets, sums)
            ]
            pipeline = transfer.pipeline
            real = pipeline.host_copies

            def spoiled(copies, buffer, stream, client_, to_device):
                real(copies, buffer, stream, client_, to_device)
                last = copies[-1]  # a unit whose last page is page 1: spoil its last staged byte
                last_row = last.host_offset + (last.height - 1) * last.host_pitch
                if to_device and 0 <= last_row - scratch.offsets[1] < layout.page_bytes:
                    buffer[sum(c.height for c in copies) * last.width - 1] ^= 0x10

            monkeypatch.setattr(pipeline, "host_copies", spoiled)
            with pytest.raises(ChunkChecksumMismatch) as info:
                transfer.load(torch.zeros_like(kv), 0, headers).verify()
            assert info.value.chunk_index == 1
    finally:
        scratch.release(client)


@pytest.mark.parametrize("enqueue", ["thread", "lazy", "eager"])
def test_load_waits_per_layer_and_reports_a_failed_enqueue(fake, client, monkeypatch, enqueue):
    """Each layer's copies land before wait_layer returns, however they are enqueued; a copy that
    cannot be enqueued fails the load (never a silent partial load) and wait_all still returns."""
    layout = LAYOUTS["bf16"]
    scratch = reserve_scratch(client, layout.page_bytes, 4)
    try:
        config = TransferConfig(staging_bytes=1 << 20, min_copy_bytes=layout.layer_bytes, load_enqueue=enqueue)
        with CudaTransfer(layout, client, CPU, config) as transfer:
            data, headers = stored_pages(transfer, layout, scratch.offsets, seed=6)
            kv = torch.zeros_like(data)
            handle = transfer.load(kv, 0, headers)
            for layer in range(layout.num_layers):
                handle.wait_layer(layer)
                assert torch.equal(kv[layer].view(torch.int16), data[layer].view(torch.int16))
            handle.wait_all()
            assert handle.end.recorded and handle.seconds is not None  # end recorded after every copy

            runtime = sys.modules["cuda.bindings.runtime"]
            calls = {"n": 0}
            real = runtime.cudaMemcpy2DAsync

            def fail_after_first(*args):
                calls["n"] += 1
                return real(*args) if calls["n"] == 1 else (fake_cuda.Err.cudaErrorInvalidValue,)

            monkeypatch.setattr(runtime, "cudaMemcpy2DAsync", fail_after_first)
            if enqueue == "eager":  # every copy is enqueued inside load(): it raises there
                with pytest.raises(CopyError):
                    transfer.load(torch.zeros_like(data), 0, headers)
            else:
                handle = transfer.load(torch.zeros_like(data), 0, headers)
                with pytest.raises(RuntimeError, match="could not be enqueued"):
                    for layer in range(layout.num_layers):
                        handle.wait_layer(layer)
                handle.wait_all()
                assert handle.end.recorded  # wait_all waited for the copies that were enqueued
            assert calls["n"] >= 2
    finally:
        scratch.release(client)


def test_the_thread_mode_enqueues_the_first_group_before_load_returns(fake, client, monkeypatch):
    """With load_enqueue="thread" the caller enqueues the first layer group inside load(): a thread
    started then would get the GIL only when the reader blocks in wait_layer. Here the thread is
    held back until after load() returns, so only the caller can have enqueued that group."""
    layout = LAYOUTS["bf16"]
    scratch = reserve_scratch(client, layout.page_bytes, 4)
    held: list = []

    class HeldThread:
        def __init__(self, target, args, **_):
            self.run = lambda: target(*args)
            held.append(self)

        def start(self):
            pass

        def join(self):
            self.run()

    monkeypatch.setattr("kvshare.transfer.cuda.threading.Thread", HeldThread)
    try:
        config = TransferConfig(staging_bytes=1 << 20, min_copy_bytes=layout.layer_bytes, load_enqueue="thread")
        with CudaTransfer(layout, client, CPU, config) as transfer:
            data, headers = stored_pages(transfer, layout, scratch.offsets, seed=7)
            kv = torch.zeros_like(data)
            handle = transfer.load(kv, 0, headers)
            assert len(held) == 1 and handle.first_copy_s is not None
            assert handle._recorded[0].is_set() and not handle._recorded[-1].is_set()
            first_layers = handle._group_of_layer.count(0)
            assert torch.equal(kv[:first_layers].view(torch.int16), data[:first_layers].view(torch.int16))
            assert not kv[first_layers:].any()  # the rest is the thread's
            handle.verify()  # joins the thread: every group, every page checked
            assert torch.equal(kv.view(torch.int16), data.view(torch.int16))
    finally:
        scratch.release(client)


def test_staging_too_small_for_one_row_is_refused(fake, client):
    layout = LAYOUTS["f32"]
    with pytest.raises(ValueError, match="staging"):
        CudaTransfer(
            layout, client, CPU, TransferConfig(staging_bytes=layout.layer_bytes, min_copy_bytes=2 * layout.layer_bytes)
        )
    assert fake.registered == {}


def test_cuda_checks_run_under_the_fake_but_cannot_see_ordering(fake, client):
    """Everything runs in program order here, so the controls pass by luck: only a GPU can catch them."""
    from kvshare.transfer.ordercheck import cuda_checks

    layout = LAYOUTS["bf16"]
    config = ByteCheckConfig(layout=layout)
    scratch = reserve_scratch(client, layout.page_bytes, 12)
    try:
        cases = make_cases(scratch.offsets, EXTENT_BYTES, seed=0)
        # program order only without the enqueue thread (with it, the unwaited read may beat the copies)
        tconfig = dataclasses.replace(stress_config(layout), load_enqueue="eager")
        results = cuda_checks(client, cases, scratch.offsets, config, tconfig, CPU)
    finally:
        scratch.release(client)
    by_kind = {}
    for r in results:
        by_kind.setdefault(r.kind, []).append(r)
    assert [r.path for r in by_kind["round_trip"]] == ["cuda/memcpy2d", "cuda/torch"]
    assert all(r.passed for r in by_kind["round_trip"] + by_kind["ordering"]) and len(by_kind["ordering"]) == 4
    assert all(not r.caught for r in by_kind["control"]) and len(by_kind["control"]) == 4


def test_loaded_cudart_libraries_are_found_in_the_process_maps(tmp_path):
    from kvshare.transfer.registration import _loaded_cudart_paths

    maps = tmp_path / "maps"
    lib = "/site-packages/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        f"7f02-7f03 r-xp 00000000 08:01 2   {lib}\n7f04-7f05 r--p 00000000 08:01 2   {lib}\n"
        "7f06-7f07 rw-p 00000000 00:00 0 \n"
    )
    assert _loaded_cudart_paths(str(maps)) == [lib]


@pytest.mark.parametrize("how", ["client closed", "last transfer closed"])
def test_the_arena_is_unpinned_only_after_every_enqueued_copy_ended(fake, pool_socket, monkeypatch, how):
    """A copy still in flight when a failure path gives the arena up (a lost link closes the client, a worker
    drops its staging) must end before cudaHostUnregister: the device is synchronized first. Fails when
    registration._wait_for_copies is removed (no synchronize precedes the unregistration)."""
    from kvshare.pool.client import PoolClient

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("synchronize"))
    unregister = fake.cudaHostUnregister
    monkeypatch.setattr(fake, "cudaHostUnregister", lambda ptr: events.append("unregister") or unregister(ptr))
    client = PoolClient(pool_socket).connect()
    transfer = CudaTransfer(LAYOUTS["f32"], client, CPU, TransferConfig(copy_method="torch"))
    events.clear()
    if how == "client closed":
        client.close(end_holds=False)
    else:
        transfer.pipeline.load_lane.synchronize = lambda: None  # only the registration's own wait is under test
        transfer.close()
        client.close()
    assert fake.registered == {} and "unregister" in events
    assert events.index("synchronize") < events.index("unregister")
