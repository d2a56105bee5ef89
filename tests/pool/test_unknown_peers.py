"""A peer whose pid SO_PEERCRED cannot name (0: a client in another pid namespace, as in a container) can never
be known gone, so its holds outlive its connection (orphaned) until it says goodbye or their TTL passes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from kvshare.pool import daemon as pool_daemon
from kvshare.pool import protocol as P
from kvshare.pool.client import PoolClient, PoolRequestError
from kvshare.pool.daemon import PoolConfig, PoolServer
from kvshare.pool.peers import PeerCredentials
from kvshare.pool.spawn import kvshare_command, kvshare_env, wait_for_pool
from tests.pool import workers
from tests.pool.conftest import MiB, make_keys
from tests.pool.test_handlers import NS, PAGE, make
from tests.pool.test_processes import wait_until


def pidfds_name_processes() -> bool:
    """Whether this kernel's pidfds tell processes apart (SO_PEERPIDFD and pidfs: Linux >= 6.9)."""
    from kvshare.pool.holders import pidfd_inode

    pidfd = os.pidfd_open(os.getpid())
    try:
        return pidfd_inode(pidfd) != 0
    finally:
        os.close(pidfd)


def start_pid_zero_pool(tmp_path, monkeypatch) -> tuple[PoolServer, threading.Thread]:
    """A pool in a thread of this process that sees every peer as pid 0 (as a pool in a child pid namespace does)."""
    monkeypatch.setattr(pool_daemon, "peer_credentials", lambda sock: PeerCredentials(0, os.getuid(), os.getgid()))
    config = PoolConfig(
        socket_path=str(tmp_path / "pool.sock"), size_bytes=16 * MiB, extent_bytes=4 * MiB, hugepages="off", tick_s=0.02
    )
    server = PoolServer(config)
    server.start()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    return server, thread


def test_a_closed_connection_of_a_peer_in_another_pid_namespace_keeps_its_holds(tmp_path, monkeypatch):
    """Through the daemon, every peer seen as pid 0: a reader that drops its connection without goodbye (a
    timeout; its copy may still run) keeps its lease, over several ticks; a reconnect with its token ends it.
    Fails when an unknown pid counts as gone (holders.Process.is_gone true for pid 0: the lease ends at once)."""
    server, thread = start_pid_zero_pool(tmp_path, monkeypatch)
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
        with PoolClient(path, name="reader", holder=reader.holder) as again:  # the same process, reconnected
            if not pidfds_name_processes():  # a token alone never joins two pid-0 connections: TTL ends the lease
                with pytest.raises(PoolRequestError, match="another client"):
                    again.release([lease.lease_id], wait=True)
                return
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


SAY_GOODBYE_AS = """
import sys
from kvshare.pool.client import PoolClient
PoolClient(sys.argv[1], holder=bytes.fromhex(sys.argv[2])).connect().close()
"""


def test_another_process_with_the_same_token_does_not_become_the_holder_of_a_pid_zero_peer(tmp_path, monkeypatch):
    """Every peer seen as pid 0: a process with the holder token of another (a forked child inherits it) connects
    and says goodbye. Fails when the pool takes the token alone for the holder (0 == 0): the goodbye ends the
    other process's lease, whose copy may still run."""
    server, thread = start_pid_zero_pool(tmp_path, monkeypatch)
    path = server.config.socket_path
    try:
        workers.write_pages(path, "held", 2, MiB)
        owner = PoolClient(path, name="owner").connect()
        lease = owner.lookup(make_keys("held", 2), MiB)
        assert lease.num_pages == 2
        other = subprocess.run([sys.executable, "-c", SAY_GOODBYE_AS, path, owner.holder.hex()], env=child_env())
        assert other.returncode == 0
        assert owner.stats()["leases"] == 1, "another process's goodbye ended the lease"
        owner.release([lease.lease_id], wait=True)
        owner.close()
    finally:
        server.stop()
        thread.join(10)


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.getcwd()}


HOLD_AND_WAIT = """
import sys, time
from kvshare.pool.client import PoolClient
from tests.pool.conftest import make_keys
client = PoolClient(sys.argv[1], holder=bytes.fromhex(sys.argv[2])).connect()
print(client.lookup(make_keys("held", 2), 1 << 20).lease_id, flush=True)
time.sleep(600)
"""


def can_unshare_pid_namespace() -> bool:
    try:
        return subprocess.run(["unshare", "-U", "-r", "-p", "-f", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not can_unshare_pid_namespace(), reason="unshare cannot make a user and pid namespace here")
@pytest.mark.skipif(not pidfds_name_processes(), reason="pidfds do not name processes here (Linux < 6.9)")
def test_a_pool_in_a_child_pid_namespace_tells_its_peers_apart_and_sees_them_exit(tmp_path):
    """``kvshare pool`` in a pid namespace of its own (unshare), its clients outside: SO_PEERCRED names them pid 0.
    A process that holds a lease is killed after another process with its token said goodbye: the goodbye must
    leave the lease alone, the kill end it. Fails when the pool takes the token alone for the holder (the goodbye
    ends the lease), and where it cannot see a pid-0 peer exit (SO_PEERPIDFD, Linux >= 6.5) the lease stays."""
    path = str(tmp_path / "pool.sock")
    cmd = ["unshare", "-U", "-r", "-p", "-f", "--mount-proc", *kvshare_command("WARNING")]
    cmd += ["pool", "--size", "16MiB", "--socket", path, "--hugepages", "off"]
    pool = subprocess.Popen(cmd, env=kvshare_env())
    owner = None
    try:
        wait_for_pool(path, proc=pool)
        workers.write_pages(path, "held", 2, MiB)
        token = os.urandom(16)
        owner = subprocess.Popen(
            [sys.executable, "-c", HOLD_AND_WAIT, path, token.hex()], stdout=subprocess.PIPE, text=True, env=child_env()
        )
        assert int(owner.stdout.readline())
        assert (
            subprocess.run([sys.executable, "-c", SAY_GOODBYE_AS, path, token.hex()], env=child_env()).returncode == 0
        )
        with PoolClient(path, name="checker") as checker:
            assert checker.stats()["leases"] == 1, "a goodbye with the token ended another process's lease"
            owner.kill()
            owner.wait()
            assert wait_until(lambda: checker.stats()["leases"] == 0, timeout=5.0), "the killed holder's lease stayed"
    finally:
        if owner is not None:
            owner.kill()
            owner.wait()
        pool.kill()
        pool.wait()
