"""The connector's hint address: the router's prefetch hints arrive here, on a thread of the worker process.

``HintListener`` binds the replica's hint address (a Unix socket path, made owner-only, or ``HOST:PORT``),
accepts the router's connections and reads their frames (kvshare.router.hints). A frame whose tag does not
verify under the replica's key, that is too old, or that does not decode is refused (``on_refused``, with
why), the connection kept; a frame over the size bound closes its connection. Each verified hint goes to
``on_hint`` on this thread. ``on_tick`` runs at least every ``tick_s`` (the prefetches' housekeeping: leases
to release, copies to drop). Nothing here waits on vLLM, and vLLM never waits on this thread.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import threading
from collections.abc import Callable

from kvshare.router.hints import HintRefused, PrefetchHint, decode_hint, frame_length, parse_address

log = logging.getLogger("kvshare.integrations")
MAX_CONNECTIONS = 16  # routers in front of one replica; a further connection is closed at once
_HEADER = 4


class _Reader:
    """One connection's bytes until a whole frame is in."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def frames(self, data: bytes) -> list[bytes]:
        """The frames completed by ``data`` (raises HintRefused for a frame over the bound)."""
        self.buffer += data
        done = []
        while len(self.buffer) >= _HEADER:
            length = frame_length(bytes(self.buffer[:_HEADER]))
            if len(self.buffer) < _HEADER + length:
                break
            done.append(bytes(self.buffer[_HEADER : _HEADER + length]))
            del self.buffer[: _HEADER + length]
        return done


class HintListener:
    """Receives verified prefetch hints on ``address`` on a thread of its own, from ``start`` to ``close``."""

    def __init__(
        self,
        address: str,
        key: str,
        on_hint: Callable[[PrefetchHint], None],
        on_refused: Callable[[str], None],
        on_tick: Callable[[], None] = lambda: None,
        tick_s: float = 0.05,
    ) -> None:
        if not key:
            raise ValueError(
                "hint_address needs the key the router signs hints with (account_key_file or $KVSHARE_ACCOUNT_KEY)"
            )
        self.address, self._key = address, key
        self._on_hint, self._on_refused, self._on_tick, self._tick_s = on_hint, on_refused, on_tick, tick_s
        self._selector = selectors.DefaultSelector()
        self._server = self._bind(address)
        self._selector.register(self._server, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvshare-hints", daemon=True)

    @staticmethod
    def _bind(address: str) -> socket.socket:
        kind, target = parse_address(address)
        if kind == "unix":
            if os.path.exists(target) and stat.S_ISSOCK(os.lstat(target).st_mode):
                os.unlink(target)  # a socket left by a replica that is gone
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(target)
            os.chmod(target, 0o600)  # prompts are private: only this user's router connects
        else:
            server = socket.create_server(target, reuse_port=False)
        server.listen(MAX_CONNECTIONS)
        server.setblocking(False)
        return server

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(self._tick_s):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.fileobj, key.data)
            try:
                self._on_tick()
            except Exception:  # the housekeeping of copies ahead: never the end of the thread
                log.error("kvshare: prefetch housekeeping failed", exc_info=True)

    def _accept(self) -> None:
        try:
            conn, _ = self._server.accept()
        except BlockingIOError:
            return
        if len(self._selector.get_map()) > MAX_CONNECTIONS:
            conn.close()
            return
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ, _Reader())

    def _read(self, conn: socket.socket, reader: _Reader) -> None:
        try:
            data = conn.recv(1 << 20)
        except OSError:  # a broken connection
            data = b""
        try:
            frames = reader.frames(data) if data else None
        except HintRefused as exc:  # a frame over the bound: the connection goes
            self._on_refused(str(exc))
            frames = None
        if frames is None:
            self._selector.unregister(conn)
            conn.close()
            return
        for frame in frames:
            try:
                hint = decode_hint(frame, self._key)
            except HintRefused as exc:
                self._on_refused(str(exc))
                continue
            try:
                self._on_hint(hint)
            except Exception:  # a hint is for speed only: a failure to act on it is logged, never raised
                log.error("kvshare: acting on a prefetch hint failed", exc_info=True)

    def close(self) -> None:
        """Stop the thread and unbind the address (a Unix socket's path is removed)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()
        kind, target = parse_address(self.address)
        if kind == "unix" and os.path.exists(target):
            os.unlink(target)
