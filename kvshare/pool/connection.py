"""One client connection of the pool daemon: its buffers and the non-blocking IO on its socket.

Nothing here blocks: the daemon's one loop serves every client, so a client that
stops reading, or sends what is not the protocol, may cost the loop only a
bounded amount of memory and work (docs/operations.md, "What the pool refuses").
"""

from __future__ import annotations

import array
import selectors
import socket
from collections import deque
from dataclasses import dataclass, field

from kvshare.pool import protocol as P

# A hello is a few dozen bytes: a client announcing a longer first frame is not speaking the protocol.
MAX_HELLO_BYTES = 4096
# Unsent replies past which a client's requests are no longer read, until it reads: a client that never reads then
# fills its own socket buffer and blocks, costing the loop nothing (one read's replies can pass it; the bound that
# closes it is PoolConfig.max_unsent_bytes).
READ_PAUSE_BYTES = 256 << 10


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    client_id: int
    pid: int
    uid: int
    connected_at: float = 0.0  # time.monotonic() at accept
    is_greeted: bool = False
    owed_fds: list[int] = field(default_factory=list)  # memfds that go with the first unsent byte (the hello reply's)
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    is_closing: bool = False
    events: int = selectors.EVENT_READ  # what the daemon's selector watches on the socket (registered at accept)
    # frames not handled yet: while a reply is deferred (a lookup that goes on to the remote tier),
    # the client's later messages wait here, so every client is answered in order
    pending: deque = field(default_factory=deque)

    def recv_some(self) -> bytes | None:
        """What the socket holds now (b"" when the peer closed, None when nothing came); before hello, no more than a
        hello can hold, so what a stranger sends costs the loop little."""
        try:
            return self.sock.recv(1 << 16 if self.is_greeted else MAX_HELLO_BYTES + P.FRAME_HEADER.size)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""

    def first_frame_bytes(self) -> int | None:
        """The length the first frame in ``inbuf`` announces, once its header is in."""
        return P.FRAME_HEADER.unpack_from(self.inbuf)[0] if len(self.inbuf) >= P.FRAME_HEADER.size else None

    def send_unsent(self) -> None:
        """Send what the socket takes now, the owed memfds with the first byte; raises OSError when the connection is
        broken."""
        if not self.outbuf:
            return
        try:
            if self.owed_fds:
                fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", self.owed_fds))]
                sent = self.sock.sendmsg([self.outbuf], fds)
                self.owed_fds = []
            else:
                sent = self.sock.send(self.outbuf)
        except (BlockingIOError, InterruptedError):
            return
        del self.outbuf[:sent]

    @property
    def is_reading(self) -> bool:
        return len(self.outbuf) <= READ_PAUSE_BYTES


def send_now(sock: socket.socket, data: bytes) -> None:
    """Best-effort send of a final error before closing."""
    try:
        sock.setblocking(False)
        sock.send(data)
    except OSError:
        pass


def socket_is_live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()
