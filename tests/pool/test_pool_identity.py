"""A pool is named by a random id drawn when its daemon starts, never by its pid: a daemon restarted with the old
one's pid (PID 1 in a container) is another pool, and the ids of its holds name other holds."""

from __future__ import annotations

import contextlib
import threading

from kvshare.pool import protocol as P
from kvshare.pool.client import PoolClient
from kvshare.pool.daemon import PoolConfig, PoolServer
from kvshare.pool.link import PoolLink
from tests.pool import workers
from tests.pool.conftest import MiB, make_keys
from tests.pool.test_bad_input import RawClient

PAGE = 1 * MiB


@contextlib.contextmanager
def pool_in_this_process(socket_path: str, before_serve=None):
    """A daemon on a thread of this process: every such daemon has this process's pid. ``before_serve(server)``
    runs between start and the serving loop."""
    server = PoolServer(PoolConfig(socket_path=socket_path, size_bytes=16 * MiB, extent_bytes=4 * MiB, hugepages="off"))
    server.start()
    if before_serve is not None:
        before_serve(server)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(10)


def test_a_hold_of_a_pool_never_ends_a_hold_of_a_restarted_pool_with_the_same_pid(tmp_path):
    """Two daemons of one pid, one after the other. The link takes a lease from the first; the first goes; the
    link reconnects to the second and takes a lease there, whose id is the same (ids restart in every pool). The
    first lease's copy then ends and the link files its release: it must not end the second pool's lease, whose
    copy may still run.
    Fails when PoolLink names pools by HelloReply.server_pid (the release ends the live lease: 0 leases left)."""
    path = str(tmp_path / "pool.sock")
    keys = make_keys("held", 2)
    link = PoolLink(path, "scheduler", timeout_s=5.0, retry_s=0.01)
    with pool_in_this_process(path):
        workers.write_pages(path, "held", 2, PAGE)
        first = link.client()
        first_pool = link.pool_id
        stale = first.lookup(keys, PAGE)
    with pool_in_this_process(path):
        workers.write_pages(path, "held", 2, PAGE)
        second = link.reconnect_now()
        assert second.hello.server_pid == first.hello.server_pid and link.pool_id != first_pool
        live = second.lookup(keys, PAGE)
        assert live.lease_id == stale.lease_id and live.num_pages == 2
        link.end_later(lease_id=stale.lease_id, pool_id=first_pool)
        link.reconnect_now()  # holds filed for later are ended at every connect, when theirs is the same pool
        with PoolClient(path, name="checker") as checker:
            assert checker.stats()["leases"] == 1
            checker.check_integrity()
        link.close()


def test_every_daemon_draws_its_own_pool_id(tmp_path):
    """Fails when the hello reply carries no pool id, or a fixed one (the pid, say)."""
    ids = []
    for _ in range(2):
        with pool_in_this_process(str(tmp_path / "pool.sock")) as server:
            with PoolClient(server.config.socket_path) as client:
                assert len(client.hello.pool_id) == P.POOL_ID_BYTES
                ids.append(client.hello.pool_id)
    assert ids[0] != ids[1]


def test_a_client_of_the_previous_protocol_is_refused_with_a_reason(tmp_path):
    """A client of protocol 3 (it knows no pool id) gets a one-line refusal and a closed connection, not a hang;
    the pool serves on."""
    with pool_in_this_process(str(tmp_path / "pool.sock")) as server:
        old = RawClient(server.config.socket_path, version=3)
        assert isinstance(old.hello, P.ErrorReply) and old.hello.code == "version_mismatch"
        assert "run the same kvshare version" in old.hello.message
        assert old.reply() is None  # closed by the pool
        with PoolClient(server.config.socket_path) as client:
            assert client.stats()["leases"] == 0
