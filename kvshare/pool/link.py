"""PoolLink: one process's connection to the pool, the one policy for timeouts, reconnects and holds.

An engine must keep serving (cold) when the pool is gone or slow, and must never
let a page go while a copy it enqueued may still touch it. So:

- Timeouts: a request that times out (``timeout_s``) raises and the connection is
  dropped, but the holds stay: the pool keys them by this link's holder token, and
  keeps them while this process lives (kvshare.pool.holders). A lookup is waited
  for as long as the pool may legitimately hold it on top (a promotion from its
  remote tier: HelloReply.lookup_wait_s).
- Reconnects: after a failure, ``client()`` answers None at once until the backoff
  (``retry_s`` doubling up to ``retry_max_s``) has passed, then connects again with
  the same holder token, so leases and reservations taken before are released or
  committed through the new connection.
- Holds: they end when the owner says its copies have ended (release, commit, abort,
  or ``close()``), when this process exits, or by the pool's TTLs. Before a client is
  given up, the ``on_drop`` hooks run: the owner's transfers wait for their copies
  there (and the arena's CUDA registration waits again before it unpins).
- Watching (``watch``): a thread connects again whenever the backoff allows, without
  waiting for a call, and notices a pool that closed the connection (a restarted pool);
  the next ``client()`` then connects anew. A client may be in use (its arena read), so
  the watcher replaces one itself only while it holds the owner's idle lock, taken
  without waiting.

Thread-safe: connects, drops and the watcher's look run under one lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

from kvshare.pool.client import PoolClient, PoolRequestError, PoolUnavailable
from kvshare.pool.holders import TOKEN_BYTES

log = logging.getLogger("kvshare.pool.link")

# What a pool call may raise when the pool is gone or stuck (besides a refusal, PoolRequestError).
POOL_DOWN_ERRORS = (PoolUnavailable, TimeoutError, ConnectionError, OSError, EOFError)


class PoolLink:
    """A pool connection that an engine can lose and get back without ever blocking on it."""

    def __init__(
        self,
        socket_path: str,
        name: str,
        timeout_s: float = 30.0,
        retry_s: float = 0.5,
        retry_max_s: float | None = None,
        verify_checksums: bool = False,
        clock: Callable[[], float] = time.monotonic,
        direct: bool = True,
    ) -> None:
        self.socket_path = socket_path
        self.direct = direct  # lease fully committed chains without a round trip where the pool offers it
        self.name = name
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.retry_max_s = retry_s if retry_max_s is None else retry_max_s
        self.verify_checksums = verify_checksums
        self.holder = os.urandom(TOKEN_BYTES)  # names this process's holds in the pool, across reconnects
        self._clock = clock
        self._client: PoolClient | None = None
        self._retry_at = 0.0
        self._delay = retry_s
        self._on_connect: list[Callable[[PoolClient], None]] = []
        self._on_drop: list[Callable[[], None]] = []
        self._on_failure: list[Callable[[BaseException], None]] = []
        self._ends_due: list[tuple[bytes, str, int]] = []  # (pool id, "lease" | "reservation", hold id) to end
        self._last_pool_id = b""  # of the last connect: the pool that granted the holds still to end
        self._lock = threading.RLock()  # connect and drop: the owner's threads and the watcher
        self._is_stale = False  # the pool closed the connection (the watcher saw it): the next client() replaces it
        self._closed = threading.Event()  # close(): no connect any more; the watcher ends
        self.num_failures = 0
        self.num_connects = 0

    def on_connect(self, hook: Callable[[PoolClient], None]) -> None:
        """``hook(client)`` after each connect (e.g. set up a transfer); an exception gives the client up."""
        self._on_connect.append(hook)

    def on_drop(self, hook: Callable[[], None]) -> None:
        """``hook()`` before a client is given up: wait for the copies that touch its pages, close transfers."""
        self._on_drop.append(hook)

    def on_failure(self, hook: Callable[[BaseException], None]) -> None:
        """``hook(exc)`` when a call found the pool down (``failed``), before the client is given up."""
        self._on_failure.append(hook)

    @property
    def current(self) -> PoolClient | None:
        """The client of the last connect, whether or not it is still connected; never connects."""
        return self._client

    @property
    def is_connected(self) -> bool:
        """Whether a client is connected and the pool has not closed its end; never connects."""
        client = self._client
        return client is not None and client.is_connected and not self._is_stale

    def client(self) -> PoolClient | None:
        """A connected client, or None while the pool is unreachable (tried again once the backoff passed)."""
        with self._lock:
            if self.is_connected:
                return self._client
            if self._client is not None:
                self.drop()
            if self._closed.is_set() or self._clock() < self._retry_at:
                return None
            return self._connect()

    def _connect(self) -> PoolClient | None:
        client = PoolClient(
            self.socket_path,
            name=self.name,
            timeout_s=self.timeout_s,
            verify_checksums=self.verify_checksums,
            holder=self.holder,
            direct=self.direct,
        )
        try:
            client.connect()
        except (PoolRequestError, *POOL_DOWN_ERRORS) as exc:
            self._schedule_retry(f"the pool at {self.socket_path} is unreachable ({exc}); serving without it")
            return None
        try:
            for hook in self._on_connect:
                hook(client)
        except BaseException:
            client.close(end_holds=False)
            self._schedule_retry(f"cannot use the pool at {self.socket_path}")  # tried later, not at once
            raise
        if self.num_connects:
            log.warning(
                "kvshare: %s connected to the pool at %s again (%s)",
                self.name,
                self.socket_path,
                "the same pool"
                if client.hello.pool_id == self._last_pool_id
                else "a new pool: the holds of the old one ended with it",
            )
        else:
            log.info(
                "kvshare: %s connected to the pool at %s (pid %s)",
                self.name,
                self.socket_path,
                client.hello.server_pid if client.hello else "?",
            )
        self._client = client
        self._delay = self.retry_s
        self.num_connects += 1
        self._last_pool_id = client.hello.pool_id
        self._end_due_holds(client)
        return client

    def watch(self, idle_lock: threading.Lock | None = None, interval_s: float = 0.5) -> None:
        """Watch the link from a thread until ``close()``: connect when the backoff allows, notice a pool that closed
        the connection. ``idle_lock``: held by whoever uses the client; free, the watcher replaces a stale one."""
        ref = weakref.ref(self)  # the thread ends when the link is collected, too
        args = (ref, self._closed, interval_s, idle_lock)
        threading.Thread(target=_watch, args=args, daemon=True, name=f"pool watch {self.name}").start()

    def _watch_once(self, idle_lock: threading.Lock | None) -> None:
        with self._lock:
            if self._client is None:
                self.client()  # connects once the backoff allows
                return
            if not self._is_stale and self._client.is_peer_closed():
                self._is_stale = True
                log.warning("kvshare: the pool at %s closed the connection; reconnecting", self.socket_path)
            if self._is_stale and idle_lock is not None and idle_lock.acquire(blocking=False):
                try:  # nobody uses the client (nor can start to): it is ours to replace
                    self.client()
                finally:
                    idle_lock.release()

    def end_later(self, lease_id: int = 0, reservation_id: int = 0, pool_id: bytes = b"") -> None:
        """Release a lease / abort a reservation whose copies have ended, once the pool can be told (the next
        connect to the same pool); meanwhile the pool keeps it.

        ``pool_id``: the pool that granted the hold (HelloReply.pool_id; empty: the pool of the last connect).
        Hold ids restart in every pool, so a hold of an earlier pool must never be ended on this one: it may
        name a live hold. A pool's pid does not tell pools apart (a restarted daemon may get the old pid).
        """
        with self._lock:
            pool_id = pool_id or self._last_pool_id
            if pool_id and lease_id:
                self._ends_due.append((pool_id, "lease", lease_id))
            if pool_id and reservation_id:
                self._ends_due.append((pool_id, "reservation", reservation_id))

    def _end_due_holds(self, client: PoolClient) -> None:
        due, self._ends_due = self._ends_due, []
        # the others went with the pool that granted them
        due = [(kind, hold_id) for pool_id, kind, hold_id in due if pool_id == client.hello.pool_id]
        try:
            client.release([hold_id for kind, hold_id in due if kind == "lease"])
            for hold_id in [hold_id for kind, hold_id in due if kind == "reservation"]:
                try:
                    client.abort(hold_id)
                except PoolRequestError:
                    pass  # its TTL ended it already
        except POOL_DOWN_ERRORS as exc:  # the next connect tries again
            self._ends_due.extend((client.hello.pool_id, kind, hold_id) for kind, hold_id in due)
            log.warning("kvshare: could not end %d holds after reconnecting: %s", len(due), exc)

    @property
    def pool_id(self) -> bytes:
        """The id of the pool of the last connect (empty before one): names the arena and the holds' ids."""
        client = self._client
        return client.hello.pool_id if client is not None and client.hello is not None else b""

    @property
    def announces(self) -> bool:
        """Whether the pool of the last connect publishes KV events (a reserve's token ids are then announced)."""
        client = self._client
        return client is not None and client.hello is not None and client.hello.wants_token_ids

    def failed(self, exc: BaseException) -> None:
        """A call failed because the pool is gone or stuck: give the connection up (the holds stay) and
        stop using the pool until the backoff passed."""
        with self._lock:
            self.num_failures += 1
            for hook in self._on_failure:
                hook(exc)
            self.drop()
            self._schedule_retry(f"pool call failed ({type(exc).__name__}: {exc}); serving without the pool")

    def reconnect_now(self) -> PoolClient | None:
        """Drop the current connection and try a new one immediately (the pool was restarted)."""
        with self._lock:
            self.drop()
            self._retry_at = 0.0
            return self.client()

    def drop(self) -> None:
        """Give the client up, keeping its holds: the ``on_drop`` hooks first (copies end), then close."""
        with self._lock:
            self._give_up(end_holds=False)

    def close(self) -> None:
        """The owner is done: every copy has ended (the hooks wait for them), so its holds end too. No connect
        follows, and the watcher ends."""
        self._closed.set()
        with self._lock:
            self._give_up(end_holds=True)

    def _give_up(self, end_holds: bool) -> None:
        client, self._client = self._client, None
        self._is_stale = False
        if client is None:
            return
        try:
            for hook in self._on_drop:
                hook()
        finally:
            # the mapping goes once no view of it is left
            client.close(end_holds=end_holds)

    def _schedule_retry(self, reason: str) -> None:
        log.warning("kvshare: %s; next try in %.1f s", reason, self._delay)
        self._retry_at = self._clock() + self._delay
        self._delay = min(self._delay * 2, self.retry_max_s)


def _watch(ref: weakref.ref[PoolLink], closed: threading.Event, interval_s: float, idle_lock) -> None:
    """The watcher thread: holds the link only while it looks at it."""
    while not closed.wait(interval_s):
        link = ref()
        if link is None:
            return
        try:
            link._watch_once(idle_lock)
        except Exception:  # an owner's hook that cannot set up (a transfer): the owner's next call raises it
            log.exception("kvshare: watching the pool link failed")
        del link


def guarded(link: PoolLink, counters, what: str, call: Callable, default=None):
    """``call()``; or ``default`` when the pool is down (``link.failed``: retried later) or refused (a warning
    naming ``what``), each counted in ``counters.pool_errors``. The engine keeps serving either way."""
    try:
        return call()
    except POOL_DOWN_ERRORS as exc:
        counters.pool_errors += 1
        link.failed(exc)
    except PoolRequestError as exc:
        counters.pool_errors += 1
        log.warning("kvshare: the pool refused %s: %s", what, exc)
    return default
