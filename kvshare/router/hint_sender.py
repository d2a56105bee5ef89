"""The router's side of the prefetch hints: one connection per vLLM replica that has a hint address.

``send(index, hint)`` signs the hint (kvshare.router.hints) and writes it to replica ``index``'s connection
without waiting: the request it describes is forwarded at once, whatever becomes of its hint. A hint that
cannot go now is dropped, never queued behind a slow replica: no connection yet (one is opened, at most every
``RECONNECT_S``), or more than ``MAX_BUFFERED_BYTES`` already waiting to be written to it. Counted per
outcome (``sent``, ``dropped``, ``refused``: a hint the router could not build or sign).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvshare.router.hints import PrefetchHint, encode_hint, parse_address

log = logging.getLogger("kvshare.router")
RECONNECT_S = 1.0  # after a failed or lost connection, the next attempt waits at least this long
MAX_BUFFERED_BYTES = 8 << 20  # a replica not reading: its hints are dropped once this much waits for it
CONNECT_TIMEOUT_S = 2.0


class _Connection:
    """One replica's hint connection: opened in the background, given up on any error."""

    def __init__(self, address: str) -> None:
        self.kind, self.target = parse_address(address)
        self.address = address
        self.writer: asyncio.StreamWriter | None = None
        self._opening: asyncio.Task | None = None
        self._last_attempt = float("-inf")

    def writable(self) -> asyncio.StreamWriter | None:
        """The open writer, or None (then a connection is opened in the background if none is on its way)."""
        if self.writer is not None and not self.writer.is_closing():
            return self.writer
        self.writer = None
        now = time.monotonic()
        if (self._opening is None or self._opening.done()) and now - self._last_attempt >= RECONNECT_S:
            self._last_attempt = now
            self._opening = asyncio.get_running_loop().create_task(self._open())
        return None

    async def _open(self) -> None:
        try:
            if self.kind == "unix":
                opening = asyncio.open_unix_connection(self.target)
            else:
                opening = asyncio.open_connection(*self.target)
            _, self.writer = await asyncio.wait_for(opening, CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            log.debug("hint connection to %s failed: %s", self.address, exc)

    async def close(self) -> None:
        if self._opening is not None:
            self._opening.cancel()
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass


class HintSender:
    """Sends prefetch hints to the replicas whose ``addresses`` are given (None: that replica takes no hints)."""

    def __init__(
        self, addresses: Sequence[str | None], key: str, on_outcome: Callable[[str], None] = lambda outcome: None
    ) -> None:
        """``on_outcome``: called with each hint's outcome ("sent", "dropped", "refused"), e.g. a metric's."""
        if any(addresses) and not key:
            raise ValueError("prefetch hints are signed with the account key: give --account-key-file")
        self._key = key
        self._connections = [_Connection(a) if a else None for a in addresses]
        self.counts: Counter[str] = Counter()
        self._on_outcome = on_outcome

    def takes_hints(self, index: int) -> bool:
        return self._connections[index] is not None

    def start(self) -> None:
        """Open every connection in the background (call on the router's loop): the first hints find them open."""
        for connection in self._connections:
            if connection is not None:
                connection.writable()

    def send(self, index: int, hint: PrefetchHint) -> bool:
        """Write ``hint`` to replica ``index`` now, or drop it; whether it went. Call on the router's loop."""
        connection = self._connections[index]
        if connection is None:
            return False
        try:
            frame = encode_hint(hint, self._key)
        except ValueError as exc:
            log.debug("no hint for a request: %s", exc)
            return self._count("refused")
        writer = connection.writable()
        if writer is None or writer.transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
            return self._count("dropped")
        try:
            writer.write(frame)
        except (OSError, RuntimeError) as exc:  # the connection broke: the next hint reconnects
            log.debug("hint connection to %s lost: %s", connection.address, exc)
            writer.close()
            return self._count("dropped")
        return self._count("sent")

    def _count(self, outcome: str) -> bool:
        self.counts[outcome] += 1
        self._on_outcome(outcome)
        return outcome == "sent"

    async def close(self) -> None:
        for connection in self._connections:
            if connection is not None:
                await connection.close()
