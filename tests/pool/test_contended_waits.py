"""While the cores are contended (CPU pressure), neither end of the pool socket spins: the client waits for a reply
in one blocking poll and the daemon in one blocking select, so each leaves the core to whoever needs it."""

from __future__ import annotations

import os
import resource
import socket
import time

import pytest

from kvshare.pool import client as pool_client
from kvshare.pool import daemon as pool_daemon
from kvshare.pool import protocol as P
from kvshare.pool.client import PoolClient
from kvshare.pool.daemon import PoolServer
from kvshare.pool.spin import MAX_MISSES
from tests.pool.conftest import make_keys
from tests.pool.test_pool_identity import pool_in_this_process

NS = b"n" * 16
NUM_ROUND_TRIPS = 200


class Contended:
    """A CpuPressure whose cores are always oversubscribed."""

    is_always = True

    def __init__(self, *args, **kwargs) -> None:
        pass

    def is_contended(self) -> bool:
        return self.is_always


class CountingSocket:
    """The client's socket, counting the receives that found nothing (a spin polls with them)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.num_polls = 0

    def recv(self, size: int, flags: int = 0) -> bytes:
        try:
            return self._sock.recv(size, flags)
        except BlockingIOError:
            self.num_polls += 1
            raise

    def __getattr__(self, name):
        return getattr(self._sock, name)


class CountingSelector:
    """The daemon's selector, counting selects that do not block (a busy poll)."""

    def __init__(self, selector) -> None:
        self._selector = selector
        self.num_polls = 0

    def select(self, timeout=None):
        if timeout == 0:
            self.num_polls += 1
        return self._selector.select(timeout)

    def __getattr__(self, name):
        return getattr(self._selector, name)


class Quiet(Contended):
    is_always = False


@pytest.fixture
def contended_pool(tmp_path, monkeypatch):
    """A daemon on a thread with its selector counted; every CPU pressure reading says "contended"."""
    yield from pool_on_a_thread(tmp_path, monkeypatch, Contended)


@pytest.fixture
def quiet_pool(tmp_path, monkeypatch):
    yield from pool_on_a_thread(tmp_path, monkeypatch, Quiet)


def pool_on_a_thread(tmp_path, monkeypatch, pressure):
    monkeypatch.setattr(pool_daemon, "CpuPressure", pressure)
    monkeypatch.setattr(pool_client, "CpuPressure", pressure)

    def count_selects(server):
        server._selector = CountingSelector(server._selector)

    with pool_in_this_process(str(tmp_path / "pool.sock"), count_selects) as server:
        yield server


def round_trips(server: PoolServer) -> tuple[int, int]:
    """Lookup-and-lease + release NUM_ROUND_TRIPS times: the client's polls of its socket, the daemon's."""
    keys = make_keys("contended", 4)
    with PoolClient(server.config.socket_path, timeout_s=5.0) as client:
        reservation = client.reserve(NS, keys, 4096)
        client.commit(reservation.reservation_id, [0] * len(reservation.grants))
        counting = CountingSocket(client._sock)
        client._sock = counting
        polls_before = server._selector.num_polls
        for _ in range(NUM_ROUND_TRIPS):
            lease = client.lookup(keys, 4096)
            assert lease.num_pages == 4
            client.release([lease.lease_id])
        assert client.stats()["leases"] == 0
        client._sock = counting._sock
    return counting.num_polls, server._selector.num_polls - polls_before


def test_under_contention_a_wait_is_one_blocking_poll_and_the_daemon_never_busy_polls(contended_pool):
    """Fails when the waits spin regardless of CPU pressure (the client's nonblocking receives find nothing, the
    daemon selects without blocking after each request)."""
    client_polls, daemon_polls = round_trips(contended_pool)
    assert client_polls == 0 and daemon_polls < NUM_ROUND_TRIPS // 10


def test_with_cores_to_spare_both_ends_poll_before_they_sleep(quiet_pool):
    """The quiet machine's fast path stays: fails when the waits never spin."""
    client_polls, daemon_polls = round_trips(quiet_pool)
    assert client_polls >= MAX_MISSES and daemon_polls >= MAX_MISSES


def test_a_reply_that_does_not_come_within_the_timeout_ends_the_wait(contended_pool):
    """The blocking poll's timeout is the client's. Fails without it: the wait lasts as long as the pool is stuck
    and then gets the late reply."""

    def stuck(client_id, request):
        time.sleep(0.6)
        return P.Ok()

    contended_pool.handlers._by_type[P.GetStats] = stuck
    with PoolClient(contended_pool.config.socket_path, timeout_s=0.2) as client:
        with pytest.raises(pool_client.PoolUnavailable, match="lost the pool"):
            client.stats()


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
