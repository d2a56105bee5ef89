"""How the client reads a reply off its socket: whole in one receive (the usual case, decoded in place), in
pieces, or followed by bytes no request asked for (refused)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvshare.pool import protocol as P
from kvshare.pool.client import PoolClient


def answered_by(chunks: list[bytes]) -> PoolClient:
    """A client on a socket pair whose other end sends ``chunks`` (10 ms apart) once it has read a request."""
    ours, pools = socket.socketpair()

    def pool() -> None:
        pools.recv(1 << 16)
        for chunk in chunks:
            pools.sendall(chunk)
            time.sleep(0.01)

    threading.Thread(target=pool, daemon=True).start()
    client = PoolClient("unused", timeout_s=5.0, spin_us=0)
    client._use(ours)  # the socket pair stands for a connection: no hello
    return client


def test_a_reply_whole_in_one_receive():
    client = answered_by([P.encode(P.Ok(count=3))])
    assert client.flush() == 3


def test_a_reply_in_pieces_is_put_together():
    """Fails when the first piece is taken for the whole reply (a header that announces more is decoded as is)."""
    reply = P.encode(P.Ok(count=5))
    client = answered_by([reply[:6], reply[6:]])
    assert client.flush() == 5


def test_bytes_after_the_reply_are_refused():
    """Fails when a receive holding a reply and more is decoded as the reply alone."""
    client = answered_by([P.encode(P.Ok(count=1)) + P.encode(P.Ok(count=2))])
    with pytest.raises(P.ProtocolError, match="more than one reply"):
        client.flush()
