"""A minimal RESP2 connection for the remote tier's data path: pipelined GETs whose values land in place.

redis-py (and hiredis) turn each reply into a bytes object: for 8 MiB values that
is an allocation, a copy and page faults per value, and it ran at 0.3-0.4x of a
plain socket read here (docs/remote.md). This reader instead hands the first
bytes of each bulk reply (a part's header) to the caller, who says where the
rest goes; the payload is then received straight into that buffer (an arena
page), with no copy in user space::

    $<len>\\r\\n | head: min(len, head_bytes) | rest: len - head -> place(head, rest) | \\r\\n

Only what the data path needs: commands out as RESP arrays; simple strings,
errors, integers, bulk strings, nil and arrays in. An error reply is returned
as a RespError value (the pipeline goes on); a broken or timed-out connection
raises OSError or EOFError, and the connection must then be closed.

No length the server sends is taken as given: a bulk reply longer than its
caller's bound (a page part: format.max_value_bytes) or than MAX_REPLY_BYTES
(every other reply), or an array longer than MAX_ARRAY_ITEMS, raises
ReplyTooLong before a byte of it is allocated or read.

Nor is its pace: every receive waits at most the connection's timeout, and with a
``deadline`` (``receive_until``) no receive starts after it and none waits past it,
so a store that trickles its bytes cannot keep a reply landing in an arena page
beyond the deadline its caller set (TimeoutError, and the connection must be closed).
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from kvshare.pool.remote.config import RemoteAddress

_BUFFER_BYTES = 1 << 16
MAX_REPLY_BYTES = 1 << 20  # a reply other than a page part (set-up, CLUSTER SLOTS, small values)
MAX_ARRAY_ITEMS = 1 << 16  # CLUSTER SLOTS of a cluster with every slot a range of its own: 16384
Place = Callable[[bytes, int], "memoryview | None"]  # (head, rest length) -> where the rest goes; None: drop it


class RespError(Exception):
    """An error reply of the server (``-ERR ...``, ``-MOVED 3999 host:port``)."""


class ReplyTooLong(EOFError):
    """The server announced a reply longer than the reader's bound: the connection is out of step, close it."""


def _checked_length(line: bytes, limit: int, what: str) -> int:
    length = int(line[1:])
    if length > limit:
        raise ReplyTooLong(f"the store announced a {what} {length} long where at most {limit} can be right")
    return length


@dataclass(frozen=True)
class Endpoint:
    """One server to connect to: a TCP address or a Unix socket, with its credentials and database."""

    host: str = ""
    port: int = 6379
    unix_path: str = ""
    is_tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0
    ca_file: str = ""  # TLS: the CAs to check the server against; empty: the system's


def server_endpoint(address: RemoteAddress) -> Endpoint:
    """The endpoint of a single-server URL (redis://, rediss://, unix://); a password given apart from it wins."""
    parts = urlsplit(address.url)
    username = unquote(parts.username or "") or None
    password = address.password or unquote(parts.password or "") or None
    if parts.scheme == "unix":
        db = int(parse_qs(parts.query).get("db", ["0"])[0])
        return Endpoint(unix_path=parts.path, username=username, password=password, db=db)
    db = int(parts.path.strip("/") or 0)
    return Endpoint(
        parts.hostname or "", parts.port or 6379, "", address.is_tls, username, password, db, address.ca_file
    )


def encode_command(*args: bytes | str | int) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class RespConnection:
    """One connection; not thread-safe (a pool hands each to one thread at a time)."""

    def __init__(self, endpoint: Endpoint, timeout_s: float, deadline: float | None = None) -> None:
        """Connect and set up (AUTH, SELECT); ``deadline``: as ``receive_until``, from the set-up's replies on."""
        self.endpoint = endpoint
        if endpoint.unix_path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(endpoint.unix_path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.is_tls:
                context = ssl.create_default_context(cafile=endpoint.ca_file or None)
                sock = context.wrap_socket(sock, server_hostname=endpoint.host)
        sock.settimeout(timeout_s)
        self._sock = sock
        self._timeout_s = timeout_s
        self._deadline = deadline  # monotonic; receive_until
        self._buf = bytearray(_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unread bytes are _buf[_start:_end]
        setup = []
        if endpoint.password is not None:
            setup.append(
                ("AUTH", endpoint.username, endpoint.password) if endpoint.username else ("AUTH", endpoint.password)
            )
        if endpoint.db:
            setup.append(("SELECT", endpoint.db))
        try:
            replies = self.execute(setup)
        except BaseException:
            self.close()
            raise
        for reply in replies:
            if isinstance(reply, RespError):
                self.close()
                raise ConnectionRefusedError(f"the store refused the connection set-up: {reply}")

    def receive_until(self, deadline: float | None) -> None:
        """No receive starts after ``deadline`` (monotonic) and none waits past it; None: each waits the timeout."""
        self._deadline = deadline
        self._sock.settimeout(self._timeout_s)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    # -- out --------------------------------------------------------------------------

    def send(self, commands: list[tuple]) -> None:
        if commands:
            self._sock.sendall(b"".join(encode_command(*c) for c in commands))

    def execute(self, commands: list[tuple]) -> list:
        """Send ``commands`` in one pipeline and read one reply each."""
        self.send(commands)
        return [self.read_reply() for _ in commands]

    # -- in ---------------------------------------------------------------------------

    def read_reply(self):
        """One reply: bytes, int, None (nil), list, or a RespError value."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = _checked_length(line, MAX_REPLY_BYTES, "reply")
            if length < 0:
                return None
            value = bytearray(length)
            self._read_into(memoryview(value))
            self._crlf()
            return bytes(value)
        if kind in (b"+",):
            return bytes(rest)
        if kind == b":":
            return int(rest)
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        if kind == b"*":
            count = _checked_length(line, MAX_ARRAY_ITEMS, "reply array")
            return None if count < 0 else [self.read_reply() for _ in range(count)]
        raise EOFError(f"not a RESP reply: {bytes(line[:40])!r}")

    def read_bulk_into(self, head_bytes: int, place: Place, max_bytes: int) -> int | None | RespError:
        """A bulk reply of at most ``max_bytes``: its first ``head_bytes`` go to ``place``, the rest where it says;
        its length, None or an error."""
        line = self._line()
        if line[:1] != b"$":
            if line[:1] == b"-":
                return RespError(bytes(line[1:]).decode(errors="replace"))
            raise EOFError(f"expected a bulk reply, got {bytes(line[:40])!r}")
        length = _checked_length(line, max_bytes, "value")
        if length < 0:
            return None
        head = bytearray(min(length, head_bytes))
        self._read_into(memoryview(head))
        rest = length - len(head)
        dest = place(bytes(head), rest)
        if dest is None:
            self._skip(rest)
        else:
            if len(dest) != rest:
                raise ValueError(f"place() gave {len(dest)} bytes for a rest of {rest}")
            self._read_into(dest)
        self._crlf()
        return length

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # keep the unread tail, make room behind it
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        got = self._recv_into(self._view[self._end :])
        if not got:
            raise EOFError("the store closed the connection")
        self._end += got

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start : i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._buf):
                raise EOFError("a reply line longer than the read buffer")
            self._fill()

    def _read_into(self, dest: memoryview) -> None:
        """Exactly len(dest) bytes: first what is buffered, then straight from the socket."""
        have = min(len(dest), self._end - self._start)
        dest[:have] = self._view[self._start : self._start + have]
        self._start += have
        dest = dest[have:]
        while len(dest):
            got = self._recv_into(dest)
            if not got:
                raise EOFError("the store closed the connection")
            dest = dest[got:]

    def _recv_into(self, dest: memoryview) -> int:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the store's reply did not arrive by its deadline")
            if left < self._timeout_s:
                self._sock.settimeout(left)
        return self._sock.recv_into(dest)

    def _skip(self, n: int) -> None:
        while n:
            if self._start == self._end:
                self._fill()
            step = min(n, self._end - self._start)
            self._start += step
            n -= step

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            if self._start == self._end:
                self._start = self._end = 0
            self._fill()
        if self._buf[self._start : self._start + 2] != b"\r\n":
            raise EOFError("a bulk reply not ended by CRLF")
        self._start += 2
