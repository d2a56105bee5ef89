"""The arena: its choice of pages (pure: auto takes hugepages only when enough are free, on refuses otherwise)
and its seals (no client can change its size)."""

import fcntl
import os
import socket
import threading

import msgspec
import pytest

from kvshare.pool import protocol as P
from kvshare.pool.arena import ARENA_SEALS, HUGEPAGE_BYTES, ArenaError, uses_hugepages
from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolClient, PoolRequestError
from tests.pool.conftest import MiB, make_keys

GiB = 1 << 30


@pytest.mark.parametrize(
    "size, free, expected",
    [
        (4 * GiB, 4 * GiB, True),  # exactly enough
        (4 * GiB, 8 * GiB, True),
        (4 * GiB, 4 * GiB - HUGEPAGE_BYTES, False),  # one page short: the OS's pages, not part of each
        (4 * GiB, 0, False),  # none reserved (CI, most hosts)
        (4 * GiB + 4096, 8 * GiB, False),  # not whole 2 MiB pages
    ],
)
def test_auto_takes_hugepages_only_when_enough_are_free(size, free, expected):
    assert uses_hugepages("auto", size, free) is expected


def test_off_never_and_on_demands():
    assert uses_hugepages("off", 4 * GiB, 8 * GiB) is False
    assert uses_hugepages("on", 4 * GiB, 4 * GiB) is True
    with pytest.raises(ArenaError, match="nr_hugepages=2048"):
        uses_hugepages("on", 4 * GiB, GiB)
    with pytest.raises(ArenaError, match="multiple of 2 MiB"):
        uses_hugepages("on", 4 * GiB + 4096, 8 * GiB)
    with pytest.raises(ArenaError, match="auto, on, off"):
        uses_hugepages("yes", 4 * GiB, 8 * GiB)


def test_a_client_cannot_resize_the_arena_and_the_pool_keeps_serving(pool):
    """A client holding the arena's fd cannot shrink or grow it; pages still round-trip for another client.

    Fails when the seals are removed from create_arena: the ftruncate succeeds (and every mapping past the new
    end would fault with SIGBUS).
    """
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(5)
    raw.connect(pool)
    payload = msgspec.msgpack.encode(P.Hello(protocol_version=P.PROTOCOL_VERSION, client_name="resizer"))
    raw.sendall(P.FRAME_HEADER.pack(len(payload)) + payload)
    _data, fds, _flags, _addr = socket.recv_fds(raw, 1 << 16, 1)
    assert len(fds) == 1
    try:
        size = os.fstat(fds[0]).st_size
        assert fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & ARENA_SEALS == ARENA_SEALS
        for new_size in (0, size // 2, size + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(fds[0], new_size)
        assert os.fstat(fds[0]).st_size == size
    finally:
        os.close(fds[0])
        raw.close()
    page_bytes = 4096
    keys = make_keys("sealed", 2)
    with PoolClient(pool) as client:
        reservation = client.reserve(b"n" * 16, keys, page_bytes)
        for i, (_, offset) in enumerate(reservation.grants):
            client.page(offset, page_bytes)[:] = i + 1
        client.commit(
            reservation.reservation_id, [page_checksum(client.page(o, page_bytes)) for _, o in reservation.grants]
        )
        lease = client.lookup(keys, page_bytes)
        assert [int(client.read_checked(h)[-1]) for h in lease.pages] == [1, 2]
        client.release([lease.lease_id], wait=True)


def test_a_client_refuses_an_arena_that_is_not_sealed(tmp_path, monkeypatch):
    """A pool handing out an unsealed memfd is refused before the client maps it.

    Fails when the seal check is removed from PoolClient.connect: the client maps the arena and returns.
    """
    import kvshare.pool.arena as arena

    monkeypatch.setattr(arena, "ARENA_SEALS", 0)  # the daemon in this process seals nothing
    from kvshare.pool.daemon import PoolConfig, PoolServer

    server = PoolServer(PoolConfig(socket_path=str(tmp_path / "p.sock"), size_bytes=4 * MiB, hugepages="off"))
    server.start()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(PoolRequestError, match="not sealed"):
            PoolClient(server.config.socket_path, timeout_s=5).connect()
    finally:
        server.stop()
        thread.join(5)


def start_recording_arena_pages(tmp_path, monkeypatch, hugepages: str, allowed_uids: tuple[int, ...]) -> list[bool]:
    """Start a pool that believes 1 GiB of hugepages is free; returns whether it asked for a hugepage arena."""
    import kvshare.pool.arena as arena
    from kvshare.pool.daemon import PoolConfig, PoolServer

    asked = []
    create = arena.create_arena
    monkeypatch.setattr(arena, "hugepages_free_bytes", lambda meminfo_path="/proc/meminfo": GiB)
    monkeypatch.setattr(arena, "create_arena", lambda size, hugepages=False: asked.append(hugepages) or create(size))
    config = PoolConfig(
        socket_path=str(tmp_path / "p.sock"), size_bytes=4 * MiB, hugepages=hugepages, allowed_uids=allowed_uids
    )
    server = PoolServer(config)
    try:
        server.start()
    finally:
        server.close()
    return asked


def test_a_pool_that_admits_another_uid_never_puts_its_arena_on_hugepages(tmp_path, monkeypatch):
    """Any process with the arena's fd can punch a hole in it (fallocate; no memfd seal forbids that while writes
    are allowed): on hugepages the freed page is gone from the reserve and every mapping that touches it may die
    of SIGBUS. A process of the pool's own uid can kill the pool and its replicas anyway; one of another uid
    must not be able to. Fails when `auto` takes hugepages whoever may connect."""
    own = os.getuid()
    assert start_recording_arena_pages(tmp_path, monkeypatch, "auto", ()) == [True]
    assert start_recording_arena_pages(tmp_path, monkeypatch, "auto", (own,)) == [True]
    assert start_recording_arena_pages(tmp_path, monkeypatch, "auto", (own, own + 1)) == [False]
    with pytest.raises(ArenaError, match="--allow-uid"):
        start_recording_arena_pages(tmp_path, monkeypatch, "on", (own + 1,))
