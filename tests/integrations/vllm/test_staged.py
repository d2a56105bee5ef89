"""The connector's GPU path (staging, gpu, worker) on CPU tensors under the fake CUDA.

tests/transfer/fake_cuda.py stands in for torch.cuda and cuda-bindings: streams and events run in
program order, cudaMemcpy2DAsync really copies rows (memmove) after checking each host range lies
inside one registration. So this runs the whole data path (2-D copies of layer-group rows, the GPU
scatter/gather, WSUM32 sums in torch, commits with their kind, verification, failure reporting) on
any machine; the ordering under a delayed producer needs the GPU (test_cuda.py, kvshare validate).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvshare.integrations.vllm.metadata import StepPlan
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind, page_checksum
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool
from kvshare.transfer.base import TransferConfig
from tests.integrations.vllm.staged_replica import Replica
from tests.transfer import fake_cuda
from tests.verdicts import spy_verdicts

CPU = torch.device("cpu")
N = 8  # block size
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)  # 16 KiB pages
# rows of one layer (4 KiB) per copy, 3 pages per staging buffer: several units per layer group, both buffers
SMALL = TransferConfig(min_copy_bytes=4 << 10, staging_bytes=12 << 10)
EXTENT = "128KiB"  # 8 pages per extent: a request's run of pages crosses registrations
PROMPT = list(range(7, 7 + 10 * 32 + 5))  # ten chunks and a tail
NUM_BLOCKS = 64
ORDERS = ("LBNHC", "LBHNC", "padded", "5d")


@pytest.fixture
def fake(monkeypatch):
    fake = fake_cuda.FakeCuda()
    fake_cuda.install(monkeypatch, fake)
    return fake


@pytest.fixture(scope="module")
def pool():
    with running_pool("4MiB", ("--extent-size", EXTENT)) as socket_path:
        yield socket_path


@pytest.fixture
def flushed(pool):
    with PoolClient(pool, name="flush") as client:
        client.flush()
    return pool


def replica(socket_path, name, order="LBNHC", staged=True, **config):
    return Replica(
        socket_path, name, LAYOUT, order, NUM_BLOCKS, N, CPU, staged=staged, worker_kwargs={"transfer": SMALL}, **config
    )


def blocks_a():
    return list(range(0, 41))


def blocks_b():
    return list(range(63, 22, -1))  # descending, as a long-running vLLM hands them out


@pytest.mark.parametrize("order", ORDERS)
def test_bytes_loaded_equal_bytes_stored_through_staging(fake, flushed, order):
    a, b = replica(flushed, "A", order), replica(flushed, "B", order)
    try:
        a.fill(1)
        assert a.step("a", PROMPT, blocks_a()) is None  # stores ten chunks
        assert a.worker.counters.stored_chunks == 10
        b.fill(2)
        before = b.tokens(0, len(PROMPT), blocks_b())
        outcome = b.step("b", PROMPT, blocks_b())
        assert outcome.is_complete and outcome.loaded_end == 10 * 32  # every full chunk (the tail is computed)
        loaded = outcome.loaded_end
        assert torch.equal(b.tokens(0, loaded, blocks_b()), a.tokens(0, loaded, blocks_a()))
        assert torch.equal(b.tokens(loaded, len(PROMPT) - loaded, blocks_b()), before[:, :, loaded:])  # untouched
        assert b.worker.counters.verified_pages == 10 and b.last_errors == set()
        assert max(height for _, height in fake.copies_2d) > 1  # whole runs of pages in single 2-D copies
    finally:
        a.close(), b.close()


def test_pages_written_on_the_gpu_path_carry_wsum32_that_the_host_computes_alike(fake, flushed):
    a = replica(flushed, "A")
    try:
        a.fill(3)
        a.step("a", PROMPT, blocks_a())
        client = a.worker.link.client()
        lease = client.lookup(keys_of(a, 10), LAYOUT.page_bytes)
        assert len(lease.pages) == 10
        for page in lease.pages:
            assert page.checksum_kind == ChecksumKind.WSUM32
            assert page.checksum == page_checksum(client.page(page.offset, page.page_bytes), ChecksumKind.WSUM32)
        client.release([lease.lease_id], wait=True)
    finally:
        a.close()


def keys_of(replica_, num_chunks: int) -> list[bytes]:
    """The pool keys of PROMPT's first chunks in the replica's namespace."""
    replica_.scheduler.add_request("probe", PROMPT, None, None)
    return replica_.scheduler._keys(replica_.scheduler._requests.pop("probe"), num_chunks)


def test_every_injected_corruption_is_caught_and_the_load_ends_at_that_page(fake, flushed):
    a, b = replica(flushed, "A"), replica(flushed, "B")
    rng = random.Random(5)
    try:
        a.fill(4)
        a.step("a", PROMPT, blocks_a())
        client = a.worker.link.client()
        keys = keys_of(a, 10)
        for trial in range(12):
            lease = client.lookup(keys, LAYOUT.page_bytes)
            bad_page = rng.randrange(10)
            page = client.page(lease.pages[bad_page].offset, LAYOUT.page_bytes)
            position = rng.randrange(page.size)
            original = int(page[position])
            page[position] ^= 1 << rng.randrange(8)  # one flipped bit anywhere in the page
            outcome = b.step(f"b{trial}", PROMPT, blocks_b())
            page[position] = original
            client.release([lease.lease_id], wait=True)
            assert not outcome.is_complete and outcome.loaded_end == bad_page * 32, (trial, bad_page, position)
            assert "checksum mismatch" in outcome.reason
            expected = set(blocks_b()[bad_page * 32 // N : 10 * 32 // N])
            assert b.last_errors == expected  # the bad page's blocks and all later ones: vLLM recomputes them
            a.step(f"a{trial}", PROMPT, blocks_a())  # the bad chunk was dropped; A stores it again
        assert b.worker.counters.checksum_failures == 12
    finally:
        a.close(), b.close()


def test_a_cpu_writers_xxh3_pages_verify_on_host_threads_and_catch_corruption(fake, flushed):
    cpu_writer = Replica(flushed, "C", LAYOUT, "cpu_attn", NUM_BLOCKS, N, CPU, staged=False)
    b = replica(flushed, "B")
    try:
        cpu_writer.fill(6)
        cpu_writer.step("c", PROMPT, blocks_a())
        client = b.worker.link.client()
        lease = client.lookup(keys_of(b, 10), LAYOUT.page_bytes)
        assert {p.checksum_kind for p in lease.pages} == {ChecksumKind.XXH3}
        page = client.page(lease.pages[3].offset, LAYOUT.page_bytes)
        page[100] ^= 0x10
        outcome = b.step("b", PROMPT, blocks_b())
        client.release([lease.lease_id], wait=True)
        assert outcome.loaded_end == 3 * 32 and b.worker.counters.checksum_failures == 1
        cpu_writer.step("c2", PROMPT, blocks_a())  # stored again (the bad chunk was dropped)
        outcome = b.step("b2", PROMPT, blocks_b())
        assert outcome.is_complete
        assert torch.equal(
            b.tokens(0, outcome.loaded_end, blocks_b()), cpu_writer.tokens(0, outcome.loaded_end, blocks_a())
        )
    finally:
        cpu_writer.close(), b.close()


@pytest.mark.parametrize("writer", ["gpu", "cpu"])  # WSUM32 summed on the GPU; XXH3 on the host threads
@pytest.mark.parametrize("forced", [None, True], ids=["checked", "forced-valid"])
def test_the_staged_load_refuses_a_corrupt_page_through_the_one_check(fake, flushed, monkeypatch, writer, forced):
    """Fails when the staged load compares checksums itself: forced valid, it would still stop at page 3."""
    a = (
        replica(flushed, "A")
        if writer == "gpu"
        else Replica(flushed, "C", LAYOUT, "cpu_attn", NUM_BLOCKS, N, CPU, staged=False)
    )
    b = replica(flushed, "B")
    try:
        a.fill(8)
        a.step("a", PROMPT, blocks_a())
        client = b.worker.link.client()
        lease = client.lookup(keys_of(b, 10), LAYOUT.page_bytes)
        kind = ChecksumKind.WSUM32 if writer == "gpu" else ChecksumKind.XXH3
        assert {p.checksum_kind for p in lease.pages} == {kind}
        client.page(lease.pages[3].offset, LAYOUT.page_bytes)[100] ^= 0x10
        calls = spy_verdicts(monkeypatch, forced)
        outcome = b.step("b", PROMPT, blocks_b())
        client.release([lease.lease_id], wait=True)
        assert outcome.is_complete == bool(forced) and (forced or outcome.loaded_end == 3 * 32)
        assert lease.pages[3].checksum in [recorded for recorded, _ in calls]
    finally:
        a.close(), b.close()


def test_a_gpu_writers_pages_verify_on_a_cpu_reader(fake, flushed):
    a = replica(flushed, "A")
    cpu_reader = Replica(flushed, "C", LAYOUT, "cpu_attn", NUM_BLOCKS, N, CPU, staged=False, overlap_load=True)
    try:
        a.fill(7)
        a.step("a", PROMPT, blocks_a())
        outcome = cpu_reader.step("c", PROMPT, blocks_b())
        assert outcome.is_complete and cpu_reader.worker.counters.verified_pages == 10
        assert torch.equal(
            cpu_reader.tokens(0, outcome.loaded_end, blocks_b()), a.tokens(0, outcome.loaded_end, blocks_a())
        )
    finally:
        a.close(), cpu_reader.close()


def test_a_forward_that_never_waits_fails_the_step_and_later_loads_wait_whole(fake, flushed):
    a, b = replica(flushed, "A"), replica(flushed, "B")
    try:
        a.fill(8)
        a.step("a", PROMPT, blocks_a())
        outcome = b.step("b", PROMPT, blocks_b(), wait_layers=False)
        assert not outcome.is_complete and "never waited" in outcome.reason
        assert b.last_errors  # every loaded block is recomputed
        outcome = b.step("b2", PROMPT, blocks_b(), wait_layers=False)  # now vLLM's stream waits for the whole load
        assert outcome.is_complete
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("staged", [True, False], ids=["gpu", "cpu-overlap"])
def test_a_step_that_may_run_as_one_graph_loads_whole_first_and_later_steps_still_wait_per_layer(fake, flushed, staged):
    """A request whose prompt is loaded up to its last token computes one token: vLLM may replay that step as one
    full CUDA graph, which calls no per-layer hook. Fails when the plan's ``no_layer_hooks`` is ignored: the load
    is then failed (recomputed) and every later load of the replica waits whole."""
    if staged:
        a, b = replica(flushed, "A"), replica(flushed, "B")
    else:  # a CPU writer's xxh3 pages: a CPU reader copies those layer by layer beside the forward
        a = Replica(flushed, "W", LAYOUT, "cpu_attn", NUM_BLOCKS, N, CPU, staged=False)
        b = Replica(flushed, "C", LAYOUT, "cpu_attn", NUM_BLOCKS, N, CPU, staged=False, overlap_load=True)
    try:
        a.fill(11)
        a.step("a", PROMPT, blocks_a())
        outcome = b.step("b", PROMPT, blocks_b(), wait_layers=False, no_layer_hooks=True)
        assert outcome.is_complete and not b.last_errors
        assert torch.equal(b.tokens(0, outcome.loaded_end, blocks_b()), a.tokens(0, outcome.loaded_end, blocks_a()))
        # the replica still overlaps loads with the forward layer by layer: a forward that skips the waits without
        # the plan saying so is caught, as before
        outcome = b.step("b2", PROMPT, blocks_b(), wait_layers=False)
        assert not outcome.is_complete and "never waited" in outcome.reason
    finally:
        a.close(), b.close()


def test_stores_without_saved_layers_are_copied_in_wait_for_save(fake, flushed):
    a, b = replica(flushed, "A"), replica(flushed, "B")
    try:
        a.fill(9)
        a.step("a", PROMPT, blocks_a(), save_layers=False)
        assert a.worker.counters.stored_chunks == 10
        outcome = b.step("b", PROMPT, blocks_b())
        assert outcome.is_complete
        assert torch.equal(b.tokens(0, outcome.loaded_end, blocks_b()), a.tokens(0, outcome.loaded_end, blocks_a()))
    finally:
        a.close(), b.close()


def test_a_failed_load_aborts_the_steps_stores_of_that_request(fake, flushed):
    a, b = replica(flushed, "A"), replica(flushed, "B")
    try:
        a.fill(10)
        short = PROMPT[: 4 * 32 + 3]
        a.step("a", short, blocks_a())  # chunks 0..3
        client = a.worker.link.client()
        lease = client.lookup(keys_of(a, 4), LAYOUT.page_bytes)
        client.page(lease.pages[1].offset, LAYOUT.page_bytes)[7] ^= 1
        client.release([lease.lease_id], wait=True)
        outcome = b.step("b", PROMPT, blocks_b())  # loads chunks 0..3 (chunk 1 bad), computes and would store 4..9
        assert outcome.loaded_end == 32
        assert b.worker.counters.stored_chunks == 0  # computed from KV that failed to load: nothing stored
        with PoolClient(flushed, name="check") as check:
            check.check_integrity()
            assert check.stats()["writing"] == 0  # B's reservations were aborted, none left open
    finally:
        a.close(), b.close()


def test_a_failure_reading_a_loads_checksums_back_fails_that_load_not_the_step(fake, flushed, monkeypatch):
    """The load's blocks are recomputed and the step's stores of that request aborted; the hooks go on."""
    from kvshare.transfer.verify import PageCheck

    a, b = replica(flushed, "A"), replica(flushed, "B")
    try:
        a.fill(11)
        a.step("a", PROMPT, blocks_a())

        def unreadable(self):
            raise RuntimeError("device lost")

        monkeypatch.setattr(PageCheck, "bad_pages", unreadable)
        outcome = b.step("b", PROMPT, blocks_b())
        assert outcome.loaded_end == 0 and "RuntimeError while checking the load: device lost" in outcome.reason
        assert b.last_errors and b.worker.counters.load_failures == 1 and b.worker.counters.stored_chunks == 0
    finally:
        a.close(), b.close()


def test_sampled_verification_checks_only_the_drawn_pages(fake, flushed):
    a = replica(flushed, "A")
    b = replica(flushed, "B", verify_fraction=0.0)
    try:
        a.fill(11)
        a.step("a", PROMPT, blocks_a())
        outcome = b.step("b", PROMPT, blocks_b())
        assert outcome.is_complete and b.worker.counters.verified_pages == 0
    finally:
        a.close(), b.close()


def test_hooks_without_loads_or_stores_do_nothing(fake, flushed):
    b = replica(flushed, "B")
    try:
        plan = StepPlan()
        b.hooks.start_load(plan)
        for index in range(LAYOUT.num_layers):
            b.hooks.wait_layer(index)
            b.hooks.save_layer(index, plan)
        b.hooks.wait_for_save(plan)
        assert b.hooks.load_errors() == set() and b.hooks.take_outcomes() == []
    finally:
        b.close()


def test_wsum32_sums_of_a_page_in_pieces_on_torch_equal_the_hosts():
    from kvshare.pool.checksum import wsum32
    from kvshare.pool.wsum import add_rows, as_unsigned

    rng = np.random.default_rng(0)
    page = rng.integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8)
    words = torch.from_numpy(page.copy()).view(torch.int32)
    acc = torch.zeros(1, dtype=torch.int64)
    per_layer = LAYOUT.layer_bytes // 4
    for layer in (2, 0, 3, 1):  # any order
        add_rows(acc, words[layer * per_layer : (layer + 1) * per_layer].view(1, -1), layer * per_layer)
    assert as_unsigned(acc) == [wsum32(page)]


def test_the_validations_staged_checks_pass_in_program_order(fake, pool):
    """kvshare validate's rows for the GPU path (kvshare.integrations.vllm.ordercheck) under the fake CUDA: the
    ordered paths exact; the controls cannot be caught without real streams (the GPU run checks that)."""
    from kvshare.integrations.vllm.ordercheck import staged_checks

    with PoolClient(pool, name="ordercheck") as client:
        results = staged_checks(client, CPU, delay_cycles=1, copy_methods=("memcpy2d",), orders=("padded",))
    assert [r.kind for r in results] == ["round_trip", "ordering", "control", "ordering", "control"]
    assert all(r.bytes_checked > 0 and r.mismatched_bytes == 0 for r in results)
