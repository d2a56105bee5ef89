"""A dead or hung store never blocks or breaks local serving, and the tier recovers when the store returns."""

import threading
import time

import pytest

from kvshare.pool.client import PoolClient
from kvshare.pool.remote.breaker import CLOSED
from tests.pool.remote.conftest import (
    HAS_REDIS,
    NO_REDIS,
    MiB,
    RedisServer,
    assert_pages_equal,
    make_keys,
    remote_stats,
    two_pools,
    wait_until,
    wait_written,
    write_chain,
)

pytestmark = [pytest.mark.remote, pytest.mark.skipif(not HAS_REDIS, reason=NO_REDIS)]
PAGE = 1 * MiB
TIMEOUT = ("--remote-timeout", "2")  # a hang shows as >= 2 s
PROMPT_S = 0.5  # "answered promptly": well below that, with room for a loaded CI machine


@pytest.fixture
def server():
    s = RedisServer().start()
    yield s
    s.stop()


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def serve_locally(ca, cb, tag, num_rounds=4):
    """Commits on A, lookups of A's own pages, lookups of unknown chunks on B: each answered promptly."""
    worst = 0.0
    for round_ in range(num_rounds):
        keys = make_keys(f"{tag}-{round_}", 2)
        _, dt = timed(write_chain, ca, keys, PAGE, tag)
        worst = max(worst, dt)
        lease, dt = timed(ca.lookup, keys, PAGE)
        worst = max(worst, dt)
        assert lease.num_pages == 2
        ca.release([lease.lease_id], wait=True)
        lease, dt = timed(cb.lookup, make_keys(f"{tag}-unknown-{round_}", 2), PAGE)
        assert lease.num_pages == 0
        worst = max(worst, dt)
    return worst


def test_store_killed_mid_run_then_back(server, prefix):
    keys = make_keys(prefix, 3)
    with two_pools(server.url, prefix, *TIMEOUT) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        data = write_chain(ca, keys, PAGE, prefix)
        wait_written(ca, 3)
        server.kill()
        # the first round meets a refused connection (fast); then the breaker opens and nothing is sent
        worst = serve_locally(ca, cb, prefix + "-down")
        assert worst < 1.0, f"an operation took {worst:.2f} s while the store was down"
        assert serve_locally(ca, cb, prefix + "-down2") < PROMPT_S
        sa, sb = remote_stats(ca), remote_stats(cb)
        assert sa["errors"] >= 1 and sa["breaker_opens"] >= 1 and sa["breaker_state"] != CLOSED
        assert sa["write_failed"] + sa["write_dropped_breaker"] >= 8
        assert sb["errors"] >= 1
        lease = cb.lookup(keys, PAGE)  # B never had these: the store is gone, so it answers with nothing
        assert lease.num_pages == 0
        ca.check_integrity()
        cb.check_integrity()
        assert ca.stats()["leases"] == 0 and ca.stats()["writing"] == 0  # no pin left behind

        server.start()  # same port, empty (no persistence)
        time.sleep(1.1)  # the breaker's reset time (--remote-breaker-reset 1)
        fresh = make_keys(prefix + "-fresh", 3)
        before = remote_stats(ca)["written_pages"]
        fresh_data = write_chain(ca, fresh, PAGE, prefix)
        wait_written(ca, before + remote_stats(ca)["write_existing"] + 3)
        assert remote_stats(ca)["breaker_state"] == CLOSED
        lease = cb.lookup(fresh, PAGE)
        assert lease.num_pages == 3
        assert_pages_equal(cb, lease.pages, fresh_data)
        cb.release([lease.lease_id], wait=True)
        # A's old pages are still served locally by A
        lease = ca.lookup(keys, PAGE)
        assert_pages_equal(ca, lease.pages, data)
        ca.release([lease.lease_id], wait=True)


def test_store_hung_other_clients_are_served_and_lookups_bounded(server, prefix):
    with (
        two_pools(server.url, prefix, *TIMEOUT) as (a, b),
        PoolClient(a) as ca,
        PoolClient(b) as cb,
        PoolClient(b) as other,
    ):
        write_chain(ca, make_keys(prefix + "-warm", 1), PAGE, prefix)
        wait_written(ca, 1)
        server.pause()  # SIGSTOP: connections stay open, nothing answers
        try:
            result = {}

            def slow_lookup():
                result["lease"], result["dt"] = timed(cb.lookup, make_keys(prefix + "-hung", 2), PAGE)

            t = threading.Thread(target=slow_lookup)
            t.start()
            time.sleep(0.05)
            # while that lookup waits on the store, B serves everyone else at once
            _, dt = timed(other.stats)
            assert dt < PROMPT_S
            mine = make_keys(prefix + "-local", 2)
            _, dt = timed(write_chain, other, mine, PAGE, prefix)
            assert dt < PROMPT_S
            lease, dt = timed(other.lookup, mine, PAGE)
            assert lease.num_pages == 2 and dt < PROMPT_S
            other.release([lease.lease_id], wait=True)
            assert t.is_alive(), "all of that happened while the deferred lookup still waited on the store"
            t.join(10)
            assert result["lease"].num_pages == 0
            assert result["dt"] < 2 + PROMPT_S, "one store timeout (2 s), not retried"
            # A commits while its writes hang: the commits never wait
            for i in range(3):
                _, dt = timed(write_chain, ca, make_keys(f"{prefix}-a{i}", 2), PAGE, prefix)
                assert dt < PROMPT_S
            assert wait_until(lambda: remote_stats(ca)["breaker_opens"] >= 1, 10), remote_stats(ca)
        finally:
            server.resume()
        assert wait_until(lambda: remote_stats(ca)["write_queue_pages"] == 0, 10)
        assert ca.stats()["leases"] == 0
        ca.check_integrity()
        cb.check_integrity()


def test_write_queue_is_bounded_and_drops_are_counted(server, prefix):
    """A hung store with a patient breaker: pins stop at a quarter of the arena, the rest is dropped and counted."""
    with two_pools(server.url, prefix, *TIMEOUT, "--remote-breaker-failures", "1000") as (a, _), PoolClient(a) as ca:
        server.pause()
        try:
            for i in range(6):  # 24 MiB of commits; the 64 MiB arena pins at most 16 MiB for write-behind
                _, dt = timed(write_chain, ca, make_keys(f"{prefix}-q{i}", 4), PAGE, prefix)
                assert dt < PROMPT_S
            stats = remote_stats(ca)
            assert stats["write_queue_bytes"] <= 16 * MiB and stats["write_dropped_full"] >= 8
            assert ca.stats()["leases"] >= 1  # the pins
        finally:
            server.resume()
        assert wait_until(lambda: remote_stats(ca)["write_queue_pages"] == 0, 20), remote_stats(ca)
        assert ca.stats()["leases"] == 0
        ca.check_integrity()


def test_a_client_waits_for_a_promotion_that_takes_longer_than_its_own_timeout(server, prefix):
    """The store stalls for ~1 s while pool B promotes a chain; a client whose own reply timeout is 0.5 s (the vLLM
    connector's pool_timeout_s is 2 s, the promote timeout 5 s) gets the promoted pages. Fails when a client gives
    up on a lookup before the pool's promote timeout (the hello says it): its link goes down for its backoff and
    the promoted pages go unused."""
    keys = make_keys(prefix, 2)
    with two_pools(server.url, prefix, *TIMEOUT) as (a, b), PoolClient(a) as ca, PoolClient(b, timeout_s=0.5) as cb:
        data = write_chain(ca, keys, PAGE, prefix)
        wait_written(ca, 2)
        server.pause()
        threading.Timer(1.2, server.resume).start()
        lease, dt = timed(cb.lookup, keys, PAGE)
        assert dt > 1.0 and lease.num_pages == 2
        assert_pages_equal(cb, lease.pages, data)
        cb.release([lease.lease_id], wait=True)
        assert cb.hello.lookup_wait_s >= 3  # pool_args: --remote-promote-timeout 3
