"""Clients that do not follow the protocol cannot stall the pool's loop or grow its memory."""

import socket
import threading

import msgspec

from kvshare.pool import protocol as P
from kvshare.pool.client import PoolClient
from kvshare.pool.daemon import PoolConfig, PoolServer
from tests.pool.conftest import MiB, make_keys


def frame(message) -> bytes:
    payload = msgspec.msgpack.encode(message)
    return P.FRAME_HEADER.pack(len(payload)) + payload


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    return sock


def is_closed_by_pool(sock: socket.socket) -> bool:
    """Read (and drop) what the pool sent until it closes the connection or goes quiet for 5 s."""
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def send_until_blocked(sock: socket.socket, data: bytes, timeout_s: float = 2.0) -> int:
    """Bytes of ``data`` the pool took before the send blocked for ``timeout_s`` (or the pool closed it)."""
    sock.settimeout(timeout_s)
    view, sent = memoryview(data), 0
    try:
        while sent < len(data):
            sent += sock.send(view[sent : sent + (1 << 16)])
    except (TimeoutError, BrokenPipeError, ConnectionResetError):
        pass
    return sent


def lookups_work(path: str) -> None:
    with PoolClient(path, name="well-behaved", timeout_s=5) as client:
        for _ in range(20):
            client.lookup(make_keys("x", 4), 4096)


def test_garbage_before_hello_closes_the_connection(shared_pool):
    """Fails when the daemon answers malformed pre-hello frames with an error and keeps the connection open."""
    sock = connect(shared_pool)
    sock.sendall(P.FRAME_HEADER.pack(3) + b"\xc1\xc1\xc1")
    assert is_closed_by_pool(sock)
    sock = connect(shared_pool)
    sock.sendall(P.FRAME_HEADER.pack(1 << 20) + b"x" * 100)  # announces a megabyte where a hello is expected
    assert is_closed_by_pool(sock)
    lookups_work(shared_pool)


def test_garbage_then_hello_from_a_client_that_never_reads_does_not_stall_the_pool(shared_pool):
    """Malformed frames whose error replies fill the socket, then a hello, from a client that never reads.

    Fails on a daemon that sends the hello reply (with the fd) blocking after answering the malformed frames: its
    loop waits forever on this client and the well-behaved lookups time out.
    """
    sock = connect(shared_pool)
    send_until_blocked(sock, frame([1]) * 100_000 + frame(P.Hello(protocol_version=P.PROTOCOL_VERSION)))
    lookups_work(shared_pool)
    sock.close()


def test_a_client_that_never_reads_is_not_read_either(shared_pool):
    """Requests from a client that leaves its replies unread stop being read: its sends block, the pool's memory
    stays put. Fails when the daemon keeps reading such a client (every request is taken and its reply kept)."""
    sock = connect(shared_pool)
    sock.sendall(frame(P.Hello(protocol_version=P.PROTOCOL_VERSION)))
    requests = frame(P.Lookup(keys=make_keys("y", 1), page_bytes=4096, lease=False)) * 400_000  # ~16 MiB
    taken = send_until_blocked(sock, requests)
    assert taken < len(requests) // 4, f"the pool took {taken} of {len(requests)} bytes from a client that never reads"
    lookups_work(shared_pool)
    sock.close()


def test_a_client_whose_unsent_replies_pass_the_bound_is_closed(tmp_path):
    """Fails when _flush has no bound on a client's unsent replies: the connection stays open."""
    config = PoolConfig(
        socket_path=str(tmp_path / "p.sock"), size_bytes=16 * MiB, hugepages="off", max_unsent_bytes=256 << 10
    )
    server = PoolServer(config)
    server.start()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        keys = make_keys("big", 2000)
        with PoolClient(config.socket_path, timeout_s=5) as writer:
            reservation = writer.reserve(b"n" * 16, keys, 4096)
            writer.commit(reservation.reservation_id, [0] * len(reservation.grants))
        sock = connect(config.socket_path)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(frame(P.Hello(protocol_version=P.PROTOCOL_VERSION)))
        big = frame(P.Lookup(keys=keys, page_bytes=4096, lease=False))  # each reply carries 2000 page headers
        send_until_blocked(sock, big * 40)
        assert is_closed_by_pool(sock)
        assert server.counters.errors >= 1
        lookups_work(config.socket_path)
    finally:
        server.stop()
        thread.join(5)


def test_a_silent_connection_is_closed_after_the_hello_timeout(tmp_path):
    """Fails when the loop does not close connections that never say hello."""
    config = PoolConfig(
        socket_path=str(tmp_path / "p.sock"), size_bytes=4 * MiB, hugepages="off", hello_timeout_s=0.2, tick_s=0.05
    )
    server = PoolServer(config)
    server.start()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        assert is_closed_by_pool(connect(config.socket_path))
    finally:
        server.stop()
        thread.join(5)
