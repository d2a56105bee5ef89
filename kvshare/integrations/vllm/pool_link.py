"""A pool connection that an engine can lose and get back without ever blocking on it.

An engine must keep serving (cold) when the pool is gone: every failed call marks the
link down, and the next ``client()`` within ``retry_s`` answers None at once instead of
trying again. A pool that died without a call noticing leaves the client's arena mapped
(the memfd lives as long as a mapping does), so leased pages can still be read and verified.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from kvshare.pool.client import PoolClient, PoolRequestError, PoolUnavailable

log = logging.getLogger("kvshare.integrations")

# What a pool call may raise when the pool is gone or stuck (besides a refusal, PoolRequestError).
POOL_DOWN_ERRORS = (PoolUnavailable, TimeoutError, ConnectionError, OSError, EOFError)


class PoolLink:
    """One process's connection to the pool, reconnected lazily after a failure."""

    def __init__(
        self,
        socket_path: str,
        name: str,
        timeout_s: float = 2.0,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket_path = socket_path
        self.name = name
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._clock = clock
        self._client: PoolClient | None = None
        self._retry_at = 0.0
        self.num_failures = 0

    def client(self) -> PoolClient | None:
        """A connected client, or None while the pool is unreachable (retried every ``retry_s``)."""
        if self._client is not None and self._client.is_connected:
            return self._client
        if self._client is not None:
            self._drop_client()
        if self._clock() < self._retry_at:
            return None
        client = PoolClient(self.socket_path, name=self.name, timeout_s=self.timeout_s)
        try:
            client.connect()
        except (PoolRequestError, *POOL_DOWN_ERRORS) as exc:
            self._retry_at = self._clock() + self.retry_s
            log.warning("kvshare: pool at %s unreachable (%s); serving without it, retry in %.0f s",
                        self.socket_path, exc, self.retry_s)
            return None
        log.info("kvshare: %s connected to the pool at %s (pid %s)", self.name, self.socket_path,
                 client.hello.server_pid if client.hello else "?")
        self._client = client
        return client

    @property
    def pool_pid(self) -> int:
        """The connected pool daemon's pid (0 when not connected): names the arena leases refer to."""
        client = self._client
        return client.hello.server_pid if client is not None and client.hello is not None else 0

    def failed(self, exc: BaseException) -> None:
        """A call failed because the pool is gone or stuck: stop using it until ``retry_s`` passed."""
        self.num_failures += 1
        log.warning("kvshare: pool call failed (%s: %s); serving without the pool for %.0f s",
                    type(exc).__name__, exc, self.retry_s)
        self._drop_client()
        self._retry_at = self._clock() + self.retry_s

    def reconnect_now(self) -> PoolClient | None:
        """Drop the current connection and try a new one immediately (the pool was restarted)."""
        self._drop_client()
        self._retry_at = 0.0
        return self.client()

    def _drop_client(self) -> None:
        if self._client is not None:
            # closing the socket releases our leases and aborts our reservations in the daemon;
            # the mapping goes once no view of it is left
            self._client.close()
            self._client = None

    def close(self) -> None:
        self._drop_client()


def guarded(link, counters, what: str, call: Callable, default=None):
    """``call()``; or ``default`` when the pool is down (``link.failed``: retried later) or refused (a warning
    naming ``what``), each counted in ``counters.pool_errors``. vLLM keeps serving either way."""
    try:
        return call()
    except POOL_DOWN_ERRORS as exc:
        counters.pool_errors += 1
        link.failed(exc)
    except PoolRequestError as exc:
        counters.pool_errors += 1
        log.warning("kvshare: the pool refused %s: %s", what, exc)
    return default
