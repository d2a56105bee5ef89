"""Releases a pool client holds back: they go out with its next message, or after at most a short delay.

Sent on its own, a fire-and-forget release wakes the pool once more for every
lookup it follows. Held back, it travels in the same send as the client's next
request: the pool handles a connection's messages in order, so the release is
applied before that request is answered, and one wake-up serves both. A client
that sends nothing more has its held releases sent by the one background thread
here once they are about ``release_delay_s`` old, and by ``close()``. Holding a
lease a little longer is always safe (its pages stay pinned a few milliseconds
more); nothing here sends a release before its caller asked for it, so none
ends early.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

from kvshare.pool import protocol as P

# How long a release may wait for a next message before the background thread sends it: short against anything
# that waits for pages to be freed (eviction runs on reserves), long against the gap between two lookups of a
# busy client, so a busy client's releases ride its requests.
RELEASE_DELAY_S = 0.005


class HeldReleases:
    """Lease ids released by the caller and not sent yet; guarded by the owning client's lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_ids: list[int] = []
        self.held_since = 0.0  # when the oldest held id was added
        self.is_watched = False  # the flusher looks at the owning client
        self._clock = clock

    def add(self, lease_ids: list[int], owner) -> None:
        """Hold ``lease_ids`` of ``owner`` (a PoolClient, whose lock the caller holds); the flusher watches it."""
        if not self.lease_ids:
            self.held_since = self._clock()
        self.lease_ids.extend(lease_ids)
        if not self.is_watched:
            self.is_watched = True
            FLUSHER.watch(owner)

    def take_frame(self) -> bytes:
        """Every held id as one framed Release, to be sent now (empty when none is held); none is held after."""
        if not self.lease_ids:
            return b""
        lease_ids, self.lease_ids = self.lease_ids, []
        return P.encode(P.Release(lease_ids=lease_ids, reply=False))

    def unwatch(self, owner) -> None:
        """Nothing is held any more: the flusher stops looking at ``owner`` (under its lock, as ``add``)."""
        self.is_watched = False
        FLUSHER.forget(owner)

    def age_s(self) -> float:
        return self._clock() - self.held_since if self.lease_ids else 0.0


class ReleaseFlusher:
    """One daemon thread that has watched clients send the releases they have held about their delay.

    A watched client is looked at every ``tick_s`` (its ``send_old_releases(tick_s)`` sends what will be older
    than its delay before the next look) until it ``forget``s itself, once it holds nothing; so only a process
    whose clients hold releases wakes the thread, and a busy client's releases go out with its requests first.
    Only weak references are kept: a client dropped without close() is not kept alive here.
    """

    def __init__(self, tick_s: float = RELEASE_DELAY_S / 2) -> None:
        self.tick_s = tick_s
        self._cond = threading.Condition()
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def watch(self, client) -> None:
        """Look at ``client`` until it calls ``forget``; called under the client's lock, as ``forget`` is, so a
        client that holds releases is always watched."""
        with self._cond:
            self._watched.add(client)
            if self._thread is None or not self._thread.is_alive():  # none yet, or this is a forked child
                self._thread = threading.Thread(target=self._run, name="kvshare-pool-releases", daemon=True)
                self._thread.start()
            self._cond.notify()

    def forget(self, client) -> None:
        with self._cond:
            self._watched.discard(client)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._watched:
                    self._cond.wait()
            time.sleep(self.tick_s)
            self._look()

    def _look(self) -> None:
        """One look at every watched client (a function of its own: no client stays referenced while the
        thread sleeps)."""
        with self._cond:
            clients = list(self._watched)
        for client in clients:
            client.send_old_releases(self.tick_s)


FLUSHER = ReleaseFlusher()
