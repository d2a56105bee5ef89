"""A hold (lease or reservation) ends only when its holder says its copies ended, its process is gone, or its
TTL passed: never because a request timed out or a connection closed under a live process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolClient
from kvshare.pool.link import POOL_DOWN_ERRORS, PoolLink
from kvshare.pool.spawn import running_pool
from tests.pool import workers
from tests.pool.conftest import MiB, make_keys
from tests.pool.test_processes import ROOT, wait_until

PAGE = 1 * MiB


@pytest.fixture
def small_pool():
    """16 pages of 1 MiB in extents of 4: a few rounds of writes evict everything nobody holds."""
    with running_pool("16MiB", ("--extent-size", "4MiB"), quiet=True) as path:
        yield path


def press(path: str, rounds: int = 6) -> None:
    """Other writers fill the pool again and again: every page without a hold is evicted and rewritten
    (with bytes no held page has)."""
    with PoolClient(path, name="pressure") as writer:
        for round_ in range(rounds):
            reserved = writer.reserve(workers.NS, make_keys(f"pressure{round_}", 6), PAGE)
            for _, offset in reserved.grants:
                writer.page(offset, PAGE)[:] = 0xEE
            writer.commit(reserved.reservation_id, [page_checksum(writer.page(o, PAGE)) for _, o in reserved.grants])


def test_a_timed_out_request_keeps_the_leases_a_copy_still_reads(small_pool):
    """The vLLM scheduler's link times out (here: the pool is stopped longer than its 0.3 s timeout) while the
    worker still copies the pages its lease pins. The link gives the connection up; the lease must stay, so
    the pages are not evicted and rewritten under the copy, and the reconnected link releases it.
    Fails when a closed connection ends its holder's holds (holders.Process.is_gone always True, which is the
    rule before holders: the pages are rewritten by the pressure writers, and the release is 'unknown_lease')."""
    workers.write_pages(small_pool, "held", 4, PAGE)
    link = PoolLink(small_pool, "scheduler", timeout_s=0.3, retry_s=0.01)
    client = link.client()
    lease = client.lookup(make_keys("held", 4), PAGE)
    assert lease.num_pages == 4
    being_copied = [client.page(h.offset, PAGE) for h in lease.pages]  # views the copy still reads
    pool_pid = client.hello.server_pid
    os.kill(pool_pid, signal.SIGSTOP)
    try:
        with pytest.raises(POOL_DOWN_ERRORS):
            client.stats()
    finally:
        os.kill(pool_pid, signal.SIGCONT)
    link.failed(TimeoutError("the pool did not answer"))  # what guarded() does with it
    press(small_pool)
    for i, view in enumerate(being_copied):  # every byte the reader used is what its writer committed
        assert np.array_equal(view, workers.page_pattern(i, PAGE)), f"page {i} was rewritten under the copy"
    again = wait_until(link.client, timeout=5.0) and link.client()
    again.release([lease.lease_id], wait=True)  # the same holder, through the new connection
    assert again.stats()["leases"] == 0
    again.check_integrity()
    link.close()


def test_a_live_process_keeps_its_holds_after_its_connection_closed_until_it_exits(small_pool):
    """A process whose connection closed without a goodbye (a timeout, a protocol error) may still be copying:
    its reservation stays, and no other writer is handed its pages, until the process exits.
    Fails when a closed connection ends its holder's holds (holders.Process.is_gone always True)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.pool.workers", small_pool, "reserve-dropped", "orphan", "4", str(PAGE)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        with PoolClient(small_pool) as client:
            assert wait_until(lambda: client.stats()["orphaned_holders"] == 1)
            press(small_pool)
            stats = client.stats()
            assert stats["writing"] == 4 and stats["reservations"] == 1  # nobody else got those pages
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            assert wait_until(lambda: client.stats()["writing"] == 0)  # seen on the daemon's tick
            assert client.stats()["ended_holders"] == 1
            client.check_integrity()
    finally:
        proc.kill()
        proc.wait()


def test_a_client_with_the_same_token_releases_the_holds_and_close_ends_them(small_pool):
    """close() says the copies ended: the holds go at once. A second client of this process with the same token
    speaks for the same holder (keyed by uid, token and process)."""
    workers.write_pages(small_pool, "held", 2, PAGE)
    first = PoolClient(small_pool).connect()
    lease = first.lookup(make_keys("held", 2), PAGE)
    first.close(end_holds=False)
    with PoolClient(small_pool, holder=first.holder) as second:
        second.release([lease.lease_id], wait=True)
        taken = second.lookup(make_keys("held", 2), PAGE)
        assert second.stats()["leases"] == 1
    with PoolClient(small_pool) as checker:
        assert wait_until(lambda: checker.stats()["leases"] == 0)  # the goodbye of close() ended it
        assert taken.lease_id


def test_a_with_block_left_by_an_exception_keeps_the_holds(small_pool):
    """An exception may leave a ``with PoolClient`` block while a copy into or out of its pages still runs
    (a CUDA copy, a copy thread): the holds must outlive the block, as after a timeout, until this process
    exits, a client with the same token ends them, or their TTL.
    Fails when __exit__ says goodbye whatever the exit (the lease is released at once)."""
    workers.write_pages(small_pool, "held", 2, PAGE)
    client = PoolClient(small_pool)
    with pytest.raises(RuntimeError, match="copy failed"):
        with client:
            lease = client.lookup(make_keys("held", 2), PAGE)
            raise RuntimeError("copy failed")
    with PoolClient(small_pool, holder=client.holder) as same_holder:
        assert same_holder.stats()["leases"] == 1
        same_holder.release([lease.lease_id], wait=True)
        assert same_holder.stats()["leases"] == 0


def test_holds_ended_while_the_link_was_down_are_ended_at_its_next_connect(small_pool):
    """A lease whose copy ended and a reservation given up while the link was down (the scheduler's release,
    the worker's abort) reach the pool when the link is back; until then the pool keeps them.
    Fails without PoolLink.end_later (the holds stay until their TTL)."""
    workers.write_pages(small_pool, "held", 2, PAGE)
    link = PoolLink(small_pool, "scheduler", timeout_s=5.0, retry_s=0.01)
    client = link.client()
    lease = client.lookup(make_keys("held", 2), PAGE)
    reserved = client.reserve(workers.NS, make_keys("new", 2), PAGE)
    link.failed(TimeoutError("the pool did not answer"))
    link.end_later(lease_id=lease.lease_id)
    link.end_later(reservation_id=reserved.reservation_id)
    with PoolClient(small_pool) as checker:
        stats = checker.stats()
        assert stats["leases"] == 1 and stats["reservations"] == 1  # kept while the link is down
        assert wait_until(lambda: link.client() is not None, timeout=5.0)
        assert wait_until(lambda: (s := checker.stats())["leases"] == 0 and s["reservations"] == 0)
        checker.check_integrity()
    link.close()


def test_orphaned_holds_end_when_the_process_exits_and_a_reused_pid_is_not_taken_for_it():
    """The handlers alone, with a real peer process: its holds outlive its connection, end on the tick after
    it exited, and a pid whose start time differs (reused by another process) counts as gone.
    Fails when disconnect ends every hold at once (the rule before holders)."""
    from kvshare.pool import protocol as P
    from kvshare.pool.holders import Process
    from tests.pool.test_handlers import NS, make

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        handlers, _, clock = make()
        handlers.connect(1, pid=peer.pid, uid=os.getuid())
        handlers.hello(1, P.Hello(protocol_version=P.PROTOCOL_VERSION, holder=b"t" * 16))
        reserved = handlers.handle(1, P.Reserve(namespace=NS, keys=make_keys("orphan", 2), page_bytes=PAGE))
        assert handlers.disconnect(1) == (0, 0)  # the process lives: its copies may still run
        handlers.tick(clock())
        assert handlers.index.num_writing == 2 and handlers.counters.orphaned_holders == 1
        handlers.connect(2, pid=peer.pid, uid=os.getuid())  # it reconnects with its token: the same holder
        handlers.hello(2, P.Hello(protocol_version=P.PROTOCOL_VERSION, holder=b"t" * 16))
        assert handlers.handle(2, P.Commit(reservation_id=reserved.reservation_id, checksums=[1, 2])) == P.Ok(count=2)
        lease = handlers.handle(2, P.Lookup(keys=make_keys("orphan", 2), page_bytes=PAGE))
        assert handlers.disconnect(2) == (0, 0) and handlers.index.num_leases == 1
        peer.kill()
        peer.wait()
        handlers.tick(clock())
        assert handlers.index.num_leases == 0 and handlers.counters.ended_holders == 1 and lease.lease_id
        handlers.index.check_integrity()
    finally:
        peer.kill()
        peer.wait()
    me = Process.of(os.getpid())
    assert not me.is_gone() and Process(me.pid, me.start_ticks + 1).is_gone()
