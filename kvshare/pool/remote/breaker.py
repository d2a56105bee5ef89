"""A circuit breaker for the remote store: stop calling a store that keeps failing, try again later.

::

    CLOSED --(failure_threshold consecutive failures)--> OPEN --(reset_s passed)--> HALF_OPEN
      ^                                                   ^                            |
      +------------------- a success ---------------------+------ a failure -----------+

While OPEN nothing is sent (writes are dropped and counted, lookups are answered
from the arena alone), so a dead store costs nothing per request. Thread-safe:
worker threads report outcomes, the daemon's loop asks ``allow()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvshare.pool.remote")

CLOSED, HALF_OPEN, OPEN = 0, 1, 2  # as exported in stats["remote"]["breaker_state"]
STATE_NAMES = {CLOSED: "closed", HALF_OPEN: "half_open", OPEN: "open"}


class CircuitBreaker:
    def __init__(self, failure_threshold: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1 or reset_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and reset_s > 0")
        self.failure_threshold = failure_threshold
        self.reset_s = reset_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self.num_opens = 0

    @property
    def state(self) -> int:
        with self._lock:
            self._maybe_half_open()
            return self._state

    def allow(self) -> bool:
        """Whether an operation may be sent now (always, unless OPEN)."""
        return self.state != OPEN

    def record_success(self) -> None:
        with self._lock:
            if self._state != CLOSED:
                log.warning("remote store answers again: circuit breaker closed")
            self._failures = 0
            self._state = CLOSED

    def record_failure(self, error: str = "") -> None:
        with self._lock:
            self._failures += 1
            if self._state == HALF_OPEN or (self._state == CLOSED and self._failures >= self.failure_threshold):
                self._state = OPEN
                self._opened_at = self._clock()
                self.num_opens += 1
                log.warning(
                    "remote store failing (%s): circuit breaker open, nothing sent for %.1f s",
                    error or "no detail",
                    self.reset_s,
                )

    def _maybe_half_open(self) -> None:
        if self._state == OPEN and self._clock() - self._opened_at >= self.reset_s:
            self._state = HALF_OPEN
