"""When a replica is ready: listening and warmed up (kvshare.engine.warmup), in either order.

The server listens at once, so /health can answer 503 ("warming up") while the engine
thread runs the warm-up; requests sent meanwhile wait in the queue behind it. The ready
line is printed once both have happened; a warm-up that fails stops the replica
(``on_failed``), loudly, rather than letting it serve with the fault still ahead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvshare.serve")

WARMING_UP, READY, FAILED = "warming up", "ok", "warm-up failed"


class Readiness:
    """The warm-up's state and the ready line's gate (the engine thread and the event loop both call it)."""

    def __init__(
        self,
        is_warming_up: bool,
        on_ready: Callable[[], None] = lambda: None,
        on_failed: Callable[[BaseException], None] = lambda exc: None,
    ) -> None:
        self.status = WARMING_UP if is_warming_up else READY
        self.report: Any = None  # the WarmupReport, once done
        self.error = ""
        self.on_ready, self.on_failed = on_ready, on_failed
        self._lock = threading.Lock()
        self._is_listening = False
        self._is_announced = False

    @property
    def is_ready(self) -> bool:
        return self.status == READY

    def listening(self) -> None:
        """The server accepts connections."""
        with self._lock:
            self._is_listening = True
        self._announce()

    def run_warmup(self, warm_up: Callable[[Any], Any], engine: Any) -> None:
        """Run ``warm_up(engine)`` (in the engine thread, before any request)."""
        try:
            report = warm_up(engine)
        except BaseException as exc:
            log.exception("the warm-up failed; stopping this replica")
            with self._lock:
                self.status, self.error = FAILED, f"{type(exc).__name__}: {exc}"
            self.on_failed(exc)
            return
        with self._lock:
            self.report, self.status = report, READY
        self._announce()

    def health_fields(self) -> dict:
        """What /health adds: the warm-up's report once ready, the error when it failed."""
        if self.status == FAILED:
            return {"error": self.error}
        report = self.report.as_dict() if self.report is not None else None
        return {"warmup": report}

    def _announce(self) -> None:
        with self._lock:
            if not (self._is_listening and self.status == READY) or self._is_announced:
                return
            self._is_announced = True
        self.on_ready()
