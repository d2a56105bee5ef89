import random

import pytest

from kvshare.pool.allocator import AllocationError, Allocator

MiB = 1 << 20


def offsets(runs):
    return [r.page_offset(i) for r in runs for i in range(r.num_pages)]


def test_runs_are_consecutive_and_inside_one_extent():
    alloc = Allocator(64 * MiB, 16 * MiB)
    runs = alloc.allocate(2 * MiB, 8)
    assert len(runs) == 1 and runs[0].num_pages == 8
    run = alloc.allocate(2 * MiB, 12)
    assert [r.num_pages for r in run] == [8, 4]  # 16 MiB extent = 8 pages: a run of 12 does not fit one
    for r in runs + run:
        first_extent = r.offset // (16 * MiB)
        assert (r.offset + r.num_bytes - 1) // (16 * MiB) == first_extent
    alloc.check_integrity()


def test_two_page_sizes_interleaved_and_reclaim():
    alloc = Allocator(64 * MiB, 16 * MiB)
    a = offsets(alloc.allocate(1 * MiB, 16))  # one extent of small pages
    b = offsets(alloc.allocate(4 * MiB, 4))  # one extent of big pages
    assert len(a) == 16 and len(b) == 4
    assert alloc.num_free_pages(4 * MiB) == 8  # two free extents left
    c = offsets(alloc.allocate(1 * MiB, 33))  # takes the two free extents, one page short
    assert len(c) == 32
    assert alloc.num_free_pages(4 * MiB) == 0
    for off in b:  # model B goes idle: its extent returns to the common pool
        alloc.free(off, 4 * MiB)
    assert alloc.num_free_pages(1 * MiB) == 16
    alloc.check_integrity()
    for off in a + c:
        alloc.free(off, 1 * MiB)
    assert alloc.used_bytes == 0
    assert len(offsets(alloc.allocate(4 * MiB, 16))) == 16  # the whole arena reclaimed by one size
    alloc.check_integrity()


def test_whole_arena_allocatable_with_partial_last_extent():
    alloc = Allocator(10 * MiB, 4 * MiB)  # extents of 4, 4, 2 MiB
    assert alloc.max_pages(1 * MiB) == 10
    got = offsets(alloc.allocate(1 * MiB, 100))
    assert sorted(got) == [i * MiB for i in range(10)]
    assert alloc.allocate(1 * MiB, 1) == []


def test_bad_frees_and_sizes():
    alloc = Allocator(8 * MiB, 4 * MiB)
    [run] = alloc.allocate(1 * MiB, 1)
    with pytest.raises(AllocationError):
        alloc.free(run.offset + 1, 1 * MiB)
    with pytest.raises(AllocationError):
        alloc.free(run.offset, 2 * MiB)
    with pytest.raises(AllocationError):
        alloc.free(7 * MiB, 1 * MiB)
    with pytest.raises(AllocationError, match="extent"):
        alloc.allocate(5 * MiB, 1)
    alloc.free(run.offset, 1 * MiB)
    with pytest.raises(AllocationError):
        alloc.free(run.offset, 1 * MiB)  # double free
    alloc.check_integrity()


def test_random_churn_keeps_integrity():
    rng = random.Random(3)
    alloc = Allocator(32 * MiB, 8 * MiB)
    live = []
    sizes = [256 << 10, 1 * MiB, 2 * MiB]
    for _ in range(2000):
        if live and rng.random() < 0.5:
            off, size = live.pop(rng.randrange(len(live)))
            alloc.free(off, size)
        else:
            size = rng.choice(sizes)
            live += [(o, size) for o in offsets(alloc.allocate(size, rng.randint(1, 6)))]
    alloc.check_integrity()
    assert len({o for o, _ in live}) == len(live)


def test_default_extent_grows_with_the_arena():
    from kvshare.pool.allocator import default_extent_bytes
    from kvshare.pool.daemon import PoolConfig

    MiB, GiB = 1 << 20, 1 << 30
    # small arenas keep the old 256 MiB extents, so several page sizes still share them
    assert default_extent_bytes(256 * MiB) == 256 * MiB
    assert default_extent_bytes(4 * GiB) == 256 * MiB
    assert default_extent_bytes(8 * GiB) == 512 * MiB
    # arenas of serving size get 1 GiB: fewer, longer copies per load
    assert default_extent_bytes(16 * GiB) == GiB
    assert default_extent_bytes(80 * GiB) == GiB
    for arena in (8 * GiB, 16 * GiB, 100 * GiB):  # at least 16 extents wherever the extent was lowered or not
        assert arena // default_extent_bytes(arena) >= 16
    assert PoolConfig(socket_path="/tmp/p.sock", size_bytes=80 * GiB).extent_bytes == GiB
    assert PoolConfig(socket_path="/tmp/p.sock", size_bytes=80 * GiB, extent_bytes=256 * MiB).extent_bytes == 256 * MiB
