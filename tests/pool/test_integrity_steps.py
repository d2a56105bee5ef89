"""The idle integrity pass is incremental: bounded work per step (by count), resumable, and it still finds faults."""

import threading
import time

import pytest

from kvshare.pool.client import PoolClient
from kvshare.pool.daemon import PoolConfig, PoolServer
from kvshare.pool.integrity import integrity_steps
from tests.pool.conftest import MiB
from tests.pool.test_index import NS, PAGE, keys, make, store


def filled_index():
    """An index with committed, leased and reserved pages: every kind of item the pass checks."""
    index = make(pages=64)
    store(index, keys("a", 40))
    index.lookup(2, keys("a", 40)[:25], PAGE, now=0.0)
    index.reserve(3, NS, keys("b", 10), PAGE, 0, now=0.0)
    return index


def test_each_step_checks_at_most_max_items_and_the_pass_covers_everything():
    """Fails without PoolIndex.integrity_steps (a pass that can only run whole, 0.41 s over 200k pages)."""
    index = filled_index()
    steps = list(integrity_steps(index, max_items=7))
    assert all(n <= 7 for n in steps)
    # 16 extents, 25 leased and 10 reserved entries, 50 entries, 25 lease entries looked at again for drops
    assert sum(steps) == 16 + 25 + 10 + 50 + 25
    assert len(steps) >= sum(steps) // 7


def test_a_planted_inconsistency_is_found_at_a_later_step():
    """A lease count off by one on an entry deep in the index: the steps before it pass, then the step raises."""
    index = filled_index()
    index.entry(keys("a", 40)[30]).num_leases += 1
    steps = integrity_steps(index, max_items=5)
    num_steps_before = 0
    with pytest.raises(AssertionError, match="lease count"):
        for _ in steps:
            num_steps_before += 1
    assert num_steps_before > 3
    with pytest.raises(AssertionError, match="lease count"):
        index.check_integrity()  # the whole pass at once finds it too


def test_the_daemon_finds_a_planted_inconsistency_when_idle(tmp_path):
    """The serve loop runs the pass step by step while idle and counts what it finds."""
    config = PoolConfig(
        socket_path=str(tmp_path / "p.sock"), size_bytes=16 * MiB, extent_bytes=4 * MiB, hugepages="off", tick_s=0.02
    )
    server = PoolServer(config)
    server.start()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        with PoolClient(config.socket_path, timeout_s=5) as client:
            page_keys = keys("d", 8)
            reservation = client.reserve(NS, page_keys, 4096)
            client.commit(reservation.reservation_id, [0] * len(reservation.grants))
            assert client.stats()["errors"] == 0
            server.index.entry(page_keys[5]).num_leases += 1  # one int, written while the loop sits idle
            deadline = time.monotonic() + 10
            while client.stats()["errors"] == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert client.stats()["errors"] >= 1
    finally:
        server.stop()
        thread.join(5)
