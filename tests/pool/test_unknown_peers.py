"""A peer whose pid SO_PEERCRED cannot name (0: a client in another pid namespace, as in a container) can never
be known gone, so its holds outlive its connection (orphaned) until it says goodbye or their TTL passes."""

from __future__ import annotations

import os
import threading
import time

from kvshare.pool import daemon as pool_daemon
from kvshare.pool import protocol as P
from kvshare.pool.client import PoolClient
from kvshare.pool.daemon import PoolConfig, PoolServer
from kvshare.pool.peers import PeerCredentials
from tests.pool import workers
from tests.pool.conftest import MiB, make_keys
from tests.pool.test_handlers import NS, PAGE, make
from tests.pool.test_processes import wait_until


def test_a_closed_connection_of_a_peer_in_another_pid_namespace_keeps_its_holds(tmp_path, monkeypatch):
    """Through the daemon, every peer seen as pid 0: a reader that drops its connection without goodbye (a
    timeout; its copy may still run) keeps its lease, over several ticks; a reconnect with its token ends it.
    Fails when an unknown pid counts as gone (holders.Process.is_gone true for pid 0: the lease ends at once)."""
    monkeypatch.setattr(pool_daemon, "peer_credentials", lambda sock: PeerCredentials(0, os.getuid(), os.getgid()))
    server = PoolServer(
        PoolConfig(
            socket_path=str(tmp_path / "pool.sock"),
            size_bytes=16 * MiB,
            extent_bytes=4 * MiB,
            hugepages="off",
            tick_s=0.02,
        )
    )
    server.start()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    path = server.config.socket_path
    try:
        workers.write_pages(path, "held", 2, MiB)
        reader = PoolClient(path, name="reader").connect()
        lease = reader.lookup(make_keys("held", 2), MiB)
        assert lease.num_pages == 2
        reader.close(end_holds=False)
        assert wait_until(lambda: server.counters.disconnects >= 2, timeout=5.0)  # the writer's and the reader's
        time.sleep(0.2)  # ticks pass: an unknown peer is never found gone
        with PoolClient(path, name="checker") as checker:
            assert checker.stats()["leases"] == 1 and server.counters.orphaned_holders == 1
        with PoolClient(path, name="reader", holder=reader.holder) as again:  # the same holder, reconnected
            again.release([lease.lease_id], wait=True)
            assert again.stats()["leases"] == 0
    finally:
        server.stop()
        thread.join(10)


def test_holds_of_an_unknown_peer_end_by_goodbye_or_ttl_never_on_a_tick_before():
    """The handlers alone: a holder of pid 0 keeps its holds over ticks until their TTL; another's goodbye
    ends them at once. Fails when an unknown pid counts as gone (the first tick ends the holds)."""
    handlers, _, clock = make(lease_ttl_s=10.0, reservation_ttl_s=20.0)
    handlers.connect(1, pid=0, uid=os.getuid())
    handlers.hello(1, P.Hello(protocol_version=P.PROTOCOL_VERSION, holder=b"a" * 16))
    handlers.handle(
        1,
        P.Commit(
            reservation_id=handlers.handle(
                1, P.Reserve(namespace=NS, keys=make_keys("k", 2), page_bytes=PAGE)
            ).reservation_id,
            checksums=[1, 2],
        ),
    )
    handlers.handle(1, P.Lookup(keys=make_keys("k", 2), page_bytes=PAGE))
    handlers.handle(1, P.Reserve(namespace=NS, keys=make_keys("w", 1), page_bytes=PAGE))
    assert handlers.disconnect(1) == (0, 0)
    clock.now += 9.0
    handlers.tick(clock.now)
    assert handlers.index.num_leases == 1 and handlers.index.num_writing == 1
    clock.now += 2.0
    handlers.tick(clock.now)  # past the lease TTL, within the reservation's
    assert handlers.index.num_leases == 0 and handlers.index.num_writing == 1
    clock.now += 10.0
    handlers.tick(clock.now)
    assert handlers.index.num_writing == 0
    handlers.index.check_integrity()

    handlers.connect(2, pid=0, uid=os.getuid())
    handlers.hello(2, P.Hello(protocol_version=P.PROTOCOL_VERSION, holder=b"b" * 16))
    handlers.handle(2, P.Lookup(keys=make_keys("k", 2), page_bytes=PAGE))
    assert handlers.index.num_leases == 1
    handlers.handle(2, P.Goodbye())  # every copy has ended
    assert handlers.index.num_leases == 0
    handlers.index.check_integrity()
