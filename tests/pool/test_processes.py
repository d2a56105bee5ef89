"""Several processes against one pool daemon: sharing, races, crashes, the whole arena."""

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np

from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolClient
from tests.pool import workers
from tests.pool.conftest import MiB, make_keys

SPAWN = mp.get_context("spawn")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_until(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_writer_and_reader_processes_share_bytes(pool):
    page_bytes = 1 * MiB
    with SPAWN.Pool(2) as procs:
        sums = procs.apply(workers.write_pages, (pool, "shared", 6, page_bytes))
        digests = procs.apply(workers.read_pages, (pool, "shared", 6, page_bytes))
    expected = [hashlib.sha256(workers.page_pattern(i, page_bytes).tobytes()).hexdigest() for i in range(6)]
    assert digests == expected
    assert sums == [page_checksum(workers.page_pattern(i, page_bytes)) for i in range(6)]


def test_racing_writers_exactly_one_commit_wins_and_readers_see_whole_pages(pool):
    page_bytes, n, num_writers = 256 << 10, 3, 5
    barrier = SPAWN.Manager().Barrier(num_writers)
    with SPAWN.Pool(num_writers + 1) as procs:
        reader = procs.apply_async(workers.race_reader, (pool, "race", n, page_bytes, 3.0))
        results = [
            procs.apply_async(workers.race_writer, (pool, "race", n, page_bytes, w + 1, barrier))
            for w in range(num_writers)
        ]
        winners = [w + 1 for w, r in enumerate(results) if r.get(timeout=60)]
        looks, seen = reader.get(timeout=60)
    assert len(winners) == 1
    assert looks > 10
    with PoolClient(pool) as client:
        lease = client.lookup(make_keys("race", n), page_bytes)
        assert lease.num_pages == n
        for h in lease.pages:
            assert (client.page(h.offset, h.page_bytes) == winners[0]).all()
        client.release([lease.lease_id], wait=True)
        assert client.stats()["committed_pages"] == n
        client.check_integrity()


def _hold(pool, action, tag, n, page_bytes):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.pool.workers", pool, action, tag, str(n), str(page_bytes)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_kill_9_writer_between_reserve_and_commit(pool):
    page_bytes = 1 * MiB
    with PoolClient(pool) as client:
        proc = _hold(pool, "reserve", "crash", 4, page_bytes)
        stats = client.stats()
        assert stats["writing"] == 4 and stats["used_bytes"] == 4 * page_bytes
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_until(lambda: client.stats()["writing"] == 0)
        stats = client.stats()
        assert stats["used_bytes"] == 0 and stats["reservations"] == 0 and stats["aborted_pages"] == 4
        assert client.lookup(make_keys("crash", 4), page_bytes).num_pages == 0  # never became visible
        client.check_integrity()


def test_kill_9_reader_releases_its_lease(pool):
    page_bytes = 1 * MiB
    workers.write_pages(pool, "leased", 3, page_bytes)
    with PoolClient(pool) as client:
        proc = _hold(pool, "lease", "leased", 3, page_bytes)
        assert client.stats()["leases"] == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_until(lambda: client.stats()["leases"] == 0)
        client.check_integrity()


def test_leased_pages_survive_eviction_pressure():
    from kvshare.pool.spawn import running_pool

    page_bytes = 1 * MiB
    with running_pool("16MiB", ("--extent-size", "4MiB")) as path, PoolClient(path) as reader:
        workers.write_pages(path, "pinned", 4, page_bytes)
        lease = reader.lookup(make_keys("pinned", 4), page_bytes)
        before = [client_page.copy() for client_page in (reader.page(h.offset, page_bytes) for h in lease.pages)]
        for round_ in range(6):  # 6 x 6 pages through a 16-page pool: eviction must run
            workers.write_pages(path, f"pressure{round_}", 6, page_bytes)
        stats = reader.stats()
        assert stats["evictions"] > 0
        after = [reader.page(h.offset, page_bytes) for h in lease.pages]
        assert all((a == b).all() for a, b in zip(after, before))
        reader.release([lease.lease_id], wait=True)
        reader.check_integrity()


def test_whole_arena_every_page_written_and_verified(pool):
    page_bytes = 1 * MiB
    with PoolClient(pool) as client:
        num_pages = client.hello.arena_bytes // page_bytes
        keys = make_keys("whole", num_pages)
        res = client.reserve(b"w" * 16, keys, page_bytes)
        assert len(res.grants) == num_pages and res.num_no_room == 0
        offsets = sorted(offset for _, offset in res.grants)
        assert offsets == [i * page_bytes for i in range(num_pages)]  # the arena, every page of it
        pattern = np.arange(page_bytes // 8, dtype=np.uint64)
        sums = []
        for i, offset in res.grants:
            page = client.page(offset, page_bytes).view(np.uint64)
            page[:] = pattern ^ np.uint64(i)
            sums.append(page_checksum(page))
        client.commit(res.reservation_id, sums)
        lease = client.lookup(keys, page_bytes)
        assert lease.num_pages == num_pages
        # every page leased: nothing can be evicted, so a further reserve is refused, not blocked
        assert client.reserve(b"w" * 16, make_keys("one-more", 1), page_bytes).num_no_room == 1
        for i, header in enumerate(lease.pages):
            assert (client.page(header.offset, page_bytes).view(np.uint64) == (pattern ^ np.uint64(i))).all()
        client.release([lease.lease_id], wait=True)
        client.check_integrity()
