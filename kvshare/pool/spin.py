"""When waiting for the other end of the pool socket spins, and when it sleeps in poll.

A cross-core wake-up costs ~30 us on the VMs measured, so a waiter that polls
the socket without sleeping sees a reply that comes soon sooner. That only
pays while the other end runs on another core. When the cores are
oversubscribed (a replica's tokenizer and scheduler beside the pool on a
2-core host), a spinning client and a busy-polling daemon sharing one core
wait each other out: each spin holds the core the reply needs. So a waiter
stops spinning after ``MAX_MISSES`` waits in a row whose answer did not come
within the window (spinning was not paying) and sleeps in poll instead, and
tries a spin again every ``PROBE_EVERY`` waits, so it spins again when the load
goes. Yielding the core between polls (sched_yield) was tried and lost: with
busy neighbours the yield hands a whole time slice to one of them (lookup +
lease + release 370-500/s against 1.1-2.1k/s without it, two burners, 2 cores).
"""

from __future__ import annotations

MAX_MISSES = 4
PROBE_EVERY = 64


class SpinPolicy:
    """The spin window of each wait (pure: the caller reports whether the answer came within it)."""

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s
        self._num_misses = 0  # waits in a row whose answer came after the window
        self._num_waits = 0

    def window_s(self) -> float:
        """How long the next wait may spin before it sleeps (0: straight to poll)."""
        self._num_waits += 1
        is_paying = self._num_misses < MAX_MISSES
        return self.spin_s if is_paying or self._num_waits % PROBE_EVERY == 0 else 0.0

    def record(self, is_within_window: bool) -> None:
        """Whether the answer the last wait got came within its spin window."""
        self._num_misses = 0 if is_within_window else min(self._num_misses + 1, MAX_MISSES)
