"""Copies ahead on the router's hints (prefetch; gpu_prefetch under the fake CUDA, cpu_prefetch on CPU tensors).

Replica A stores a prompt; replica B is hinted the prompt, copies its pages ahead into its prefetch buffer,
then loads them when its scheduler side plans the load: the load takes the copy ahead where the pages' key,
pool and checksum match, verified (on the GPU path as any staged page, while it is scattered; on CPU when it
was copied, over the private copy). Bytes loaded equal bytes stored.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.integrations.vllm.gpu_prefetch import fitting
from kvshare.integrations.vllm.prefetch import Prefetcher, Regions
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.link import PoolLink
from kvshare.pool.spawn import running_pool
from kvshare.router.hints import make_hint
from kvshare.transfer.base import TransferConfig
from tests.integrations.vllm.staged_replica import Replica, namespace_of
from tests.transfer import fake_cuda

N = 8
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)  # 16 KiB pages
SMALL = TransferConfig(min_copy_bytes=4 << 10, staging_bytes=12 << 10)  # a layer (4 KiB a page) per group
PROMPT = list(range(7, 7 + 10 * 32 + 5))  # ten chunks and a tail
NUM_BLOCKS = 96
BLOCKS_A = list(range(0, 41))
BLOCKS_B = list(range(95, 54, -1))
MODEL = "staged-test"
WHOLE = 10 * LAYOUT.page_bytes  # room for the whole run


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def pool():
    with running_pool("4MiB", ("--extent-size", "128KiB")) as socket_path:
        yield socket_path


@pytest.fixture
def fake(monkeypatch):
    cuda = fake_cuda.FakeCuda()
    fake_cuda.install(monkeypatch, cuda)
    monkeypatch.setattr(fake_cuda.FakeEvent, "is_pending", False)
    return cuda


@pytest.fixture
def flushed(pool, fake):
    with PoolClient(pool, name="flush") as client:
        client.flush()
    return pool


DEVICES = pytest.mark.parametrize("staged", [True, False], ids=["gpu-fake", "cpu"])


def replica(socket_path, name, staged=True):
    return Replica(
        socket_path,
        name,
        LAYOUT,
        "LBNHC" if staged else "cpu_attn",
        NUM_BLOCKS,
        N,
        torch.device("cpu"),
        staged=staged,
        worker_kwargs={"transfer": SMALL},
    )


def with_prefetcher(b: Replica, socket_path: str, num_bytes: int, clock=None) -> Prefetcher:
    b.worker.prepare()  # the arena registered, as at a replica's start
    prefetcher = Prefetcher(
        PoolLink(socket_path, "B-prefetch"),
        LAYOUT,
        namespace_of(LAYOUT),
        [MODEL],
        b.worker.prefetch_device(num_bytes),
        ttl_s=5.0,
        clock=clock or Clock(),
    )
    b.worker.prefetcher = prefetcher
    close = b.close

    def close_both():  # as the connector's shutdown: the worker, then the copies ahead's leases and connection
        close()
        prefetcher.close()

    b.close = close_both
    return prefetcher


def leases(socket_path) -> int:
    with PoolClient(socket_path, name="stats") as client:
        return client.stats()["leases"]


@DEVICES
def test_a_load_takes_the_copy_ahead_and_the_bytes_equal_the_stored_ones(flushed, fake, staged):
    a, b = replica(flushed, "A", staged), replica(flushed, "B", staged)
    try:
        a.fill(1)
        a.step("a", PROMPT, BLOCKS_A)
        b.fill(2)
        prefetcher = with_prefetcher(b, flushed, WHOLE)
        prefetcher.on_hint(make_hint(MODEL, None, PROMPT))
        counters = prefetcher.take_counters()
        assert counters.hints == 1 and counters.prefetched_pages == 10
        assert leases(flushed) == 1  # held while its copies run
        prefetcher.tick()
        assert leases(flushed) == 0  # the copies ended: the pages are on the device
        staged_before = len(fake.copies_2d)
        outcome = b.step("b", PROMPT, BLOCKS_B)
        assert outcome.is_complete and outcome.loaded_end == 10 * 32
        assert len(fake.copies_2d) == staged_before  # every page and layer came from the copy ahead
        assert torch.equal(b.tokens(0, 10 * 32, BLOCKS_B), a.tokens(0, 10 * 32, BLOCKS_A))
        assert prefetcher.take_counters().prefetch_hits == 10
        assert b.worker.counters.verified_pages == 10  # verified as any page (on CPU: when copied ahead)
        prefetcher.tick()
        assert prefetcher.device._regions.largest() == WHOLE  # dropped once its load ended
    finally:
        a.close(), b.close()


def test_a_run_that_does_not_fit_is_copied_ahead_in_its_first_layers(flushed, fake):
    a, b = replica(flushed, "A"), replica(flushed, "B")
    try:
        a.fill(3)
        a.step("a", PROMPT, BLOCKS_A)
        b.fill(4)
        prefetcher = with_prefetcher(b, flushed, WHOLE // 2)  # two of the four layer groups
        prefetcher.on_hint(make_hint(MODEL, None, PROMPT))
        prefetcher.tick()
        outcome = b.step("b", PROMPT, BLOCKS_B)
        assert outcome.is_complete
        assert torch.equal(b.tokens(0, 10 * 32, BLOCKS_B), a.tokens(0, 10 * 32, BLOCKS_A))
        assert prefetcher.take_counters().prefetch_hits == 10
    finally:
        a.close(), b.close()


@DEVICES
def test_pages_committed_again_with_other_bytes_are_loaded_from_the_pool(flushed, fake, staged):
    a, b, c = replica(flushed, "A", staged), replica(flushed, "B", staged), replica(flushed, "C", staged)
    try:
        a.fill(5)
        a.step("a", PROMPT, BLOCKS_A)
        b.fill(6)
        prefetcher = with_prefetcher(b, flushed, WHOLE)
        prefetcher.on_hint(make_hint(MODEL, None, PROMPT))
        prefetcher.tick()
        with PoolClient(flushed, name="flush") as client:
            client.flush()  # every page evicted ...
        c.fill(7)
        c.step("c", PROMPT, BLOCKS_A)  # ... and committed again by another writer, with other bytes
        outcome = b.step("b", PROMPT, BLOCKS_B)
        assert outcome.is_complete
        assert prefetcher.take_counters().prefetch_hits == 0
        assert torch.equal(b.tokens(0, 10 * 32, BLOCKS_B), c.tokens(0, 10 * 32, BLOCKS_A))
    finally:
        a.close(), b.close(), c.close()


def test_a_bad_copy_ahead_fails_the_load_at_that_page(flushed, fake):
    a, b = replica(flushed, "A"), replica(flushed, "B")
    try:
        a.fill(8)
        a.step("a", PROMPT, BLOCKS_A)
        b.fill(9)
        prefetcher = with_prefetcher(b, flushed, WHOLE)
        prefetcher.on_hint(make_hint(MODEL, None, PROMPT))
        prefetcher.tick()
        (prefetch,) = prefetcher._book.prefetches
        prefetch.copy.source(0, 3, 1)[17] ^= 0x40  # page 3's bytes on the device, after its copy
        outcome = b.step("b", PROMPT, BLOCKS_B)
        assert outcome.loaded_end == 3 * 32 and "checksum mismatch" in outcome.reason
        assert b.last_errors == set(BLOCKS_B[3 * 32 // N : 10 * 32 // N])
    finally:
        a.close(), b.close()


def test_a_page_bad_in_the_pool_when_copied_ahead_on_cpu_ends_the_load_there_uncopied(flushed, fake):
    a, b = replica(flushed, "A", False), replica(flushed, "B", False)
    try:
        a.fill(12)
        a.step("a", PROMPT, BLOCKS_A)
        b.fill(13)
        before = b.tokens(0, 10 * 32, BLOCKS_B)
        b.scheduler.add_request("probe", PROMPT, None, None)
        keys = b.scheduler._keys(b.scheduler._requests.pop("probe"), 10)
        with PoolClient(flushed, name="vandal") as client:
            lease = client.lookup(keys, LAYOUT.page_bytes)
            client.page(lease.pages[4].offset, LAYOUT.page_bytes)[99] ^= 0x08
            client.release([lease.lease_id], wait=True)
        prefetcher = with_prefetcher(b, flushed, WHOLE)
        prefetcher.on_hint(make_hint(MODEL, None, PROMPT))
        outcome = b.step("b", PROMPT, BLOCKS_B)
        assert outcome.loaded_end == 4 * 32 and "checksum mismatch" in outcome.reason
        after = b.tokens(0, 10 * 32, BLOCKS_B)
        assert torch.equal(after[:, :, : 4 * 32], a.tokens(0, 4 * 32, BLOCKS_A))
        assert torch.equal(after[:, :, 4 * 32 :], before[:, :, 4 * 32 :])  # nothing from the bad page on
    finally:
        a.close(), b.close()


def test_a_hint_whose_request_never_comes_is_dropped_after_its_bound(flushed, fake):
    a, b = replica(flushed, "A"), replica(flushed, "B")
    clock = Clock()
    try:
        a.fill(10)
        a.step("a", PROMPT, BLOCKS_A)
        prefetcher = with_prefetcher(b, flushed, WHOLE, clock)
        monkey = fake_cuda.FakeEvent
        monkey.is_pending = True  # the copies still run: the lease stays
        prefetcher.on_hint(make_hint(MODEL, None, PROMPT))
        clock.now += 60
        prefetcher.tick()
        assert leases(flushed) == 1 and len(prefetcher._book.prefetches) == 1  # never dropped under its copies
        monkey.is_pending = False
        prefetcher.tick()
        assert leases(flushed) == 0 and prefetcher._book.prefetches == []
        assert prefetcher.take_counters().prefetches_unused == 1
        assert prefetcher.device._regions.largest() == WHOLE
    finally:
        fake_cuda.FakeEvent.is_pending = False
        a.close(), b.close()


def test_a_hint_for_another_model_or_salt_copies_nothing_a_load_takes(flushed, fake):
    a, b = replica(flushed, "A"), replica(flushed, "B")
    try:
        a.fill(11)
        a.step("a", PROMPT, BLOCKS_A)
        prefetcher = with_prefetcher(b, flushed, WHOLE)
        prefetcher.on_hint(make_hint("an-adapter", None, PROMPT))
        prefetcher.on_hint(make_hint(MODEL, "tenant-x", PROMPT))  # other keys: the pool holds none of them
        assert prefetcher.take_counters().prefetched_pages == 0 and leases(flushed) == 0
    finally:
        a.close(), b.close()


def test_regions_are_handed_out_first_fit_and_merge_when_freed():
    regions = Regions(100)
    first, second, third = regions.allocate(30), regions.allocate(30), regions.allocate(30)
    assert (first, second, third) == (0, 30, 60) and regions.allocate(20) is None
    regions.free(second)
    assert regions.largest() == 30 and regions.allocate(10) == 30
    regions.free(first), regions.free(30), regions.free(third)
    assert regions.largest() == 100


def test_a_run_copied_ahead_takes_whole_groups_else_the_first_pages_of_one():
    assert fitting(10, [4, 4, 4], 120) == (10, 3)
    assert fitting(10, [4, 4, 4], 85) == (10, 2)
    assert fitting(10, [4, 4, 4], 30) == (7, 1)
    assert fitting(10, [4, 4, 4], 3) == (0, 0)


def test_the_gpu_prefetch_buffer_takes_at_most_half_the_memory_vllm_left_free(flushed, fake):
    b = replica(flushed, "B")
    try:
        b.worker.prepare()
        fake.free_bytes = 1 << 30
        assert b.worker.prefetch_device(2048 << 20).num_bytes == 512 << 20
        fake.free_bytes = 100 << 20  # half of it is below the smallest buffer worth having
        assert b.worker.prefetch_device(2048 << 20) is None
    finally:
        b.close()


@DEVICES
def test_room_for_a_new_run_is_made_by_dropping_the_oldest_copies_no_load_holds(flushed, fake, staged):
    """Fails when an older copy ahead keeps the room (the new run then gets only what is left)."""
    a, b = replica(flushed, "A", staged), replica(flushed, "B", staged)
    other = list(range(2000, 2000 + 10 * 32 + 5))
    try:
        a.fill(14)
        a.step("a", PROMPT, BLOCKS_A)
        a.step("a2", other, list(range(41, 82)))
        prefetcher = with_prefetcher(b, flushed, WHOLE * 3 // 2)  # one run whole, and half of another
        prefetcher.on_hint(make_hint(MODEL, None, PROMPT))
        prefetcher.tick()  # its copies ended: its lease went, it may be dropped for room
        prefetcher.on_hint(make_hint(MODEL, None, other))
        (kept,) = prefetcher._book.prefetches
        assert kept.keys[0] == prefetcher._keys(make_hint(MODEL, None, other))[0]
        assert kept.copy.num_pages == 10 and getattr(kept.copy, "num_groups", 4) == 4  # whole
        held = prefetcher.take(kept.pool_id, kept.keys, kept.pages)  # a load holds it now ...
        prefetcher.on_hint(make_hint(MODEL, None, PROMPT))
        first, second = prefetcher._book.prefetches  # ... so the next run gets only what is left
        assert first is kept and second.copy.num_pages * getattr(second.copy, "num_groups", 4) < 10 * 4
        prefetcher.give_back(held)
    finally:
        a.close(), b.close()
