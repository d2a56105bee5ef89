"""Two pools (two hosts' arenas) sharing one Redis: pages written through A are served by B, byte for byte."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from kvshare.pool import protocol as P
from kvshare.pool.client import PoolClient
from kvshare.pool.direct import is_supported
from kvshare.pool.direct_reader import DIRECT_LEASE_BIT
from kvshare.pool.remote.format import num_parts, part_keys
from kvshare.pool.spawn import running_pool
from tests.pool.remote.conftest import (
    MiB,
    assert_pages_equal,
    free_port,
    make_keys,
    pool_args,
    remote_stats,
    two_pools,
    wait_until,
    wait_written,
    write_chain,
)

pytestmark = pytest.mark.remote


def test_pages_written_through_a_are_read_through_b_byte_identical(redis_server, prefix):
    page_bytes = 1 * MiB  # 4 parts of 256 KiB - 136 B each and a fifth of 544 B
    keys = make_keys(prefix, 6)
    with two_pools(redis_server.url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        data = write_chain(ca, keys, page_bytes, prefix)
        wait_written(ca, 6)
        lease = cb.lookup(keys, page_bytes)
        assert lease.num_pages == 6
        assert_pages_equal(cb, lease.pages, data)
        cb.release([lease.lease_id], wait=True)
        cb.check_integrity()
        stats_b = cb.stats()
        remote_b = stats_b["remote"]
        assert remote_b["hit_chunks"] == 6 and remote_b["promoted_pages"] == 6
        assert remote_b["promoted_bytes"] == 6 * page_bytes
        assert remote_b["written_pages"] == 0, "promoted pages must not be written back"
        assert stats_b["entries"] == 6 and stats_b["leases"] == 0
        assert stats_b["hit_chunks"] == 0 and stats_b["miss_chunks"] == 6  # the arena's own counters: local only
        # now local on B: a second lookup does not go to the store
        lease = cb.lookup(keys, page_bytes)
        assert lease.num_pages == 6 and remote_stats(cb)["lookups"] == 1
        cb.release([lease.lease_id], wait=True)
        # A keeps serving from its own arena, and wrote each part once
        assert remote_stats(ca)["written_bytes"] == 6 * page_bytes
        assert len(redis_server.client().keys(f"{prefix}:*")) == 6 * 5


def test_local_prefix_is_extended_from_the_store(redis_server, prefix):
    page_bytes = 512 << 10
    keys = make_keys(prefix, 8)
    with two_pools(redis_server.url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        data = write_chain(ca, keys, page_bytes, prefix)
        wait_written(ca, 8)
        write_chain(cb, keys[:3], page_bytes, prefix)  # B computed the first three chunks itself
        wait_written(cb, 3)
        assert remote_stats(cb)["write_existing"] == 3  # already in the store: not sent again
        lease = cb.lookup(keys, page_bytes)
        assert lease.num_pages == 8
        assert_pages_equal(cb, lease.pages, data)
        assert remote_stats(cb)["promoted_pages"] == 5
        cb.release([lease.lease_id], wait=True)
        cb.check_integrity()


def test_unknown_prefix_is_a_remote_miss_and_answered(redis_server, prefix):
    with two_pools(redis_server.url, prefix) as (_, b), PoolClient(b) as cb:
        start = time.perf_counter()
        lease = cb.lookup(make_keys(prefix + "-nowhere", 4), 1 * MiB)
        assert lease.num_pages == 0 and time.perf_counter() - start < 1.0
        stats = remote_stats(cb)
        assert stats["lookups"] == 1 and stats["miss_chunks"] == 4 and stats["hit_chunks"] == 0
        probe = cb.lookup(make_keys(prefix + "-nowhere", 4), 1 * MiB, lease=False)
        assert probe.num_pages == 0 and remote_stats(cb)["lookups"] == 1  # probes stay local


def test_messages_behind_a_deferred_lookup_are_answered_in_order(redis_server, prefix):
    """A client pipelines lookup (deferred: goes to the store) + stats + lookup: three replies, in order."""
    page_bytes = 1 * MiB
    keys = make_keys(prefix, 4)
    with two_pools(redis_server.url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as other:
        write_chain(ca, keys, page_bytes, prefix)
        wait_written(ca, 4)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(b)
        sock.sendall(P.encode(P.Hello(protocol_version=P.PROTOCOL_VERSION, client_name="raw")))
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
        for fd in fds:
            os.close(fd)
        buf = bytearray(data)
        assert isinstance(P.decode_reply(P.split_frames(buf, 1 << 20)[0]), P.HelloReply)
        sock.sendall(
            P.encode(P.Lookup(keys=keys, page_bytes=page_bytes))
            + P.encode(P.GetStats())
            + P.encode(P.Lookup(keys=keys, page_bytes=page_bytes, lease=False))
        )
        other.stats()  # another client is served meanwhile
        replies = []
        while len(replies) < 3:
            buf += sock.recv(1 << 16)
            replies += [P.decode_reply(f) for f in P.split_frames(buf, 1 << 30)]
        sock.sendall(P.encode(P.Goodbye()))  # its copies have ended: a live process's lease ends only so
        sock.close()
        first, stats, probe = replies
        assert isinstance(first, P.LookupReply) and len(first.pages) == 4 and first.lease_id
        assert isinstance(stats, P.StatsReply) and stats.stats["remote"]["promoted_pages"] == 4
        assert isinstance(probe, P.LookupReply) and len(probe.pages) == 4
        assert wait_until_no_leases(other)


def wait_until_no_leases(client: PoolClient) -> bool:
    return wait_until(lambda: client.stats()["leases"] == 0, 5)


def test_client_leaving_while_its_lookup_is_deferred(redis_server, prefix):
    page_bytes = 1 * MiB
    keys = make_keys(prefix, 4)
    with two_pools(redis_server.url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        write_chain(ca, keys, page_bytes, prefix)
        wait_written(ca, 4)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(b)
        sock.sendall(P.encode(P.Hello(protocol_version=P.PROTOCOL_VERSION)))
        socket.recv_fds(sock, 1 << 16, 1)
        sock.sendall(P.encode(P.Lookup(keys=keys, page_bytes=page_bytes)))
        sock.close()  # gone before the answer
        assert wait_until_no_leases(cb)
        assert wait_until(lambda: cb.stats()["remote"]["promotions"] == 0, 5)
        cb.check_integrity()
        lease = cb.lookup(keys, page_bytes)  # the promoted pages stayed
        assert lease.num_pages == 4
        cb.release([lease.lease_id], wait=True)


def test_remote_stats_in_pool_stats_and_metrics(redis_server, prefix):
    port = free_port()
    args = pool_args(redis_server.url, prefix, "--metrics-port", str(port))
    with running_pool("64MiB", args, quiet=True) as a, PoolClient(a) as ca:
        write_chain(ca, make_keys(prefix, 2), 1 * MiB, prefix)
        wait_written(ca, 2)
        out = subprocess.run(
            [sys.executable, "-m", "kvshare", "pool-stats", "--socket", a],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert json.loads(out.stdout)["remote"]["written_pages"] == 2
        time.sleep(0.3)  # the metrics read the daemon's snapshot, taken every tick
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kvshare_pool_remote_written_pages 2.0" in text
        assert "kvshare_pool_remote_breaker_state 0.0" in text
        assert "kvshare_pool_remote_write_queue_pages 0.0" in text


def test_two_lookups_missing_the_same_chunk_share_one_promotion(redis_server, prefix):
    page_bytes = 1 * MiB
    keys = make_keys(prefix, 4)
    with (
        two_pools(redis_server.url, prefix, "--remote-timeout", "5") as (a, b),
        PoolClient(a) as ca,
        PoolClient(b) as c1,
        PoolClient(b) as c2,
        PoolClient(b) as observer,
    ):
        data = write_chain(ca, keys, page_bytes, prefix)
        wait_written(ca, 4)
        leases = {}
        redis_server.pause()  # hold the first promotion in the store until both lookups have arrived
        try:
            threads = [
                threading.Thread(target=lambda c=c: leases.__setitem__(c, c.lookup(keys, page_bytes))) for c in (c1, c2)
            ]
            for t in threads:
                t.start()
            assert wait_until(lambda: remote_stats(observer)["joined_lookups"] == 1, 2)
        finally:
            redis_server.resume()
        for t in threads:
            t.join(10)
        for client in (c1, c2):
            assert_pages_equal(client, leases[client].pages, data)
            client.release([leases[client].lease_id], wait=True)
        stats = remote_stats(observer)
        assert stats["lookups"] == 1 and stats["joined_lookups"] == 1 and stats["promoted_pages"] == 4
        observer.check_integrity()


def test_promotion_without_room_in_the_arena(redis_server, prefix):
    page_bytes = 1 * MiB
    keys = make_keys(prefix, 4)
    args = pool_args(redis_server.url, prefix)
    with (
        running_pool("64MiB", args, quiet=True) as a,
        running_pool("16MiB", args, quiet=True) as b,
        PoolClient(a) as ca,
        PoolClient(b) as cb,
    ):
        data = write_chain(ca, keys, page_bytes, prefix)
        wait_written(ca, 4)
        own = make_keys(prefix + "-own", 14)
        write_chain(cb, own, page_bytes, prefix + "-own")
        held = cb.lookup(own, page_bytes, lease=True)  # 14 of B's 16 pages leased: not evictable
        assert held.num_pages == 14
        lease = cb.lookup(keys, page_bytes)
        assert lease.num_pages == 2
        assert_pages_equal(cb, lease.pages, data[:2])
        stats = remote_stats(cb)
        assert stats["promoted_pages"] == 2 and stats["promote_no_room"] == 2
        cb.release([lease.lease_id, held.lease_id], wait=True)
        cb.check_integrity()


def test_batches_fetched_ahead_of_a_break_in_the_chain_are_not_placed(redis_server, prefix):
    """One page per batch, two in flight: a missing chunk 2 ends the chain even though 3.. arrived."""
    page_bytes = 1 * MiB
    keys = make_keys(prefix, 6)
    other = make_keys(prefix + "-ns", 3)
    extra = ("--remote-promote-batch", "1MiB", "--remote-readers", "2")
    with two_pools(redis_server.url, prefix, *extra) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        data = write_chain(ca, keys, page_bytes, prefix)
        write_chain(ca, other[:1], page_bytes, prefix + "-ns")
        write_chain(ca, other[1:], page_bytes, prefix + "-ns", namespace=bytes(16), first_depth=1)
        wait_written(ca, 9)
        redis_server.client().delete(*part_keys(prefix, keys[2], num_parts(page_bytes, 256 << 10)))
        lease = cb.lookup(keys, page_bytes)
        assert_pages_equal(cb, lease.pages, data[:2])
        cb.release([lease.lease_id], wait=True)
        lease = cb.lookup(other, page_bytes)  # chunk 1 of another namespace, fetched before chunk 0's arrived
        assert lease.num_pages == 1
        cb.release([lease.lease_id], wait=True)
        stats = cb.stats()
        assert stats["entries"] == 3, "nothing after a break in a chain is placed"
        assert stats["remote"]["promoted_pages"] == 3 and stats["remote"]["discarded_fingerprint"] >= 1
        assert cb.lookup(keys[3:], page_bytes, lease=False).num_pages == 0
        cb.check_integrity()


@pytest.mark.skipif(not is_supported(), reason="no direct lookups here (x86-64 Linux with membarrier only)")
def test_a_direct_client_asks_a_pool_with_a_remote_tier_about_what_its_arena_lacks(redis_server, prefix):
    """With a remote tier a key the arena lacks may still be promoted: a direct client's lookup goes to the pool,
    which promotes the chain; once the pages are in the arena they come from the directory. Fails when the
    directory answers such a key as a miss (B's reader would get no pages)."""
    page_bytes = 1 * MiB
    keys = make_keys(prefix, 3)
    with two_pools(redis_server.url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b, direct=True) as cb:
        data = write_chain(ca, keys, page_bytes, prefix)
        wait_written(ca, 3)
        lease = cb.lookup(keys, page_bytes)
        assert lease.num_pages == 3 and not lease.lease_id & DIRECT_LEASE_BIT
        assert_pages_equal(cb, lease.pages, data)
        cb.release([lease.lease_id], wait=True)
        again = cb.lookup(keys, page_bytes)
        assert again.num_pages == 3 and again.lease_id & DIRECT_LEASE_BIT
        assert_pages_equal(cb, again.pages, data)
        cb.release([again.lease_id])
