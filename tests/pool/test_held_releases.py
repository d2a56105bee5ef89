"""A fire-and-forget release is held back (kvshare.pool.held_releases): it rides the client's next message, which
the pool answers only after applying it, or goes out after the client's delay, or with close(); until it is sent
the pool keeps the lease. And a reply is waited for in poll, which the pool reading a request does not wake."""

from __future__ import annotations

import os
import resource
import socket
import time

import pytest

from kvshare.pool import protocol as P
from kvshare.pool.client import PoolClient
from tests.pool.conftest import make_keys

NS = b"h" * 16
PAGE = 4096
HOURS_S = 3600.0  # a delay no test waits out: the release goes out only with a message or close()


def leased_pages(pool: str, tag: str, delay_s: float) -> tuple[PoolClient, int]:
    """A client of ``delay_s`` holding a lease on two committed pages, and the lease's id."""
    keys = make_keys(tag, 2)
    client = PoolClient(pool, name=f"holder-{tag}", timeout_s=5.0, release_delay_s=delay_s).connect()
    reservation = client.reserve(NS, keys, PAGE)
    client.commit(reservation.reservation_id, [0] * len(reservation.grants))
    lease = client.lookup(keys, PAGE)
    assert lease.lease_id and lease.num_pages == 2
    return client, lease.lease_id


def lease_ids(observer: PoolClient) -> set[int]:
    return {lease.lease_id for lease in observer.list_leases()}


def wait_until_gone(observer: PoolClient, lease_id: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while lease_id in lease_ids(observer):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_held_release_is_applied_before_the_next_request_is_answered(pool):
    """Fails when the next request goes out without the held release, or ahead of it (the stats count the lease)."""
    client, lease_id = leased_pages(pool, "next", HOURS_S)
    with client:
        client.release([lease_id])
        assert client.stats()["leases"] == 0


def test_the_pool_keeps_a_lease_until_its_held_release_is_sent(pool):
    """Another client still sees the lease after release() returned, and not after the holder's next message.
    Fails when release() sends at once (the pool ends the lease before the observer asks)."""
    client, lease_id = leased_pages(pool, "kept", HOURS_S)
    with client, PoolClient(pool, name="observer", timeout_s=5.0) as observer:
        client.release([lease_id])
        assert lease_id in lease_ids(observer)
        client.stats()
        assert lease_id not in lease_ids(observer)


def test_a_held_release_goes_out_after_the_delay_when_no_message_follows(pool):
    """Fails when only a next message or close() sends held releases (the lease stays while the holder idles)."""
    client, lease_id = leased_pages(pool, "idle", 0.05)
    with client, PoolClient(pool, name="observer", timeout_s=5.0) as observer:
        client.release([lease_id])
        assert wait_until_gone(observer, lease_id)


@pytest.mark.parametrize("end_holds", [False, True])
def test_close_sends_the_held_releases(pool, end_holds):
    """Also when the holds stay (end_holds=False: the holder's process lives, so only the release ends this lease).
    Fails when close() drops what is held."""
    client, lease_id = leased_pages(pool, f"close-{end_holds}", HOURS_S)
    with PoolClient(pool, name="observer", timeout_s=5.0) as observer:
        client.release([lease_id])
        client.close(end_holds=end_holds)
        assert wait_until_gone(observer, lease_id)


def test_waiting_for_a_reply_is_not_woken_by_the_pool_reading_the_request():
    """A pool (a forked process on a socket pair) reads the request, then answers 50 ms later. The waiting thread
    sleeps once. Fails with a blocking recv as the wait: the read makes the client's socket writable, which wakes
    the recv for nothing, and it sleeps twice."""
    ours, pools = socket.socketpair()
    reply = P.encode(P.Ok(count=7))
    pid = os.fork()
    if pid == 0:  # the pool: nothing but socket calls, then out
        ours.close()
        pools.recv(1 << 16)
        time.sleep(0.05)
        pools.sendall(reply)
        os._exit(0)
    pools.close()
    client = PoolClient("unused", timeout_s=5.0, spin_us=0)
    client._use(ours)  # the socket pair stands for a connection: no hello
    try:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        assert client.flush() == 7
        num_sleeps = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before
    finally:
        ours.close()
        os.waitpid(pid, 0)
    assert num_sleeps == 1
