"""The engine worker: one thread runs the engine, one request at a time, first come first served.

The engine is not re-entrant (it owns one sequence's KV at a time), so the
HTTP handlers never call it directly: they submit a WorkerRequest and read its events
from an asyncio queue. A job whose client went away is cancelled between
tokens, and during its prefill between layers, so a disconnected or abandoned
request frees the engine; so is every job once the worker is stopping.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvshare.errors import RequestCancelled

log = logging.getLogger("kvshare.serve")

_DONE = object()


class QueueFull(Exception):
    """The replica already holds its limit of requests."""


@dataclass(eq=False)
class WorkerRequest:
    """A request handed to the engine worker: what to run, and the queue its events come back on."""

    prompt_ids: Any  # list[int] or an int64 numpy array (the replica's: checked once, never copied again)
    params: Any  # engine SamplingParams
    options: Any  # engine RequestOptions
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    is_cancelled: bool = False
    # True once the client's connection is gone: asked with the rest before each prefill layer, since the
    # handler learns of a lost connection only when it next writes (the first token, after the prefill)
    client_gone: Callable[[], bool] | None = None
    started_s: float | None = None  # perf_counter() when the worker took the job off the queue
    # set by the handler once the first token is on its way to the client: until then the engine does not go
    # on (publishing the prompt's chunks runs Python on this thread and would hold the GIL the writer needs)
    first_written: threading.Event = field(default_factory=threading.Event)

    def post(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    async def stream(self):
        """Engine events until the end; re-raises an engine exception."""
        while True:
            item = await self.events.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


IDLE_POLL_S = 0.25  # with an idle task: how often an empty queue is re-checked for new idle work
FIRST_WRITE_WAIT_S = 0.05  # at most this long the engine waits for the handler to write the first token


class EngineWorker:
    max_running = 1  # jobs the engine runs at once: the rest wait, first come first served

    def __init__(
        self,
        engine: Any,
        max_requests: int,
        idle_task: Callable[[], bool] | None = None,
        first_task: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_requests = max_requests
        self.first_task = first_task  # runs in this thread before the first request (the warm-up)
        # runs in this thread while no request waits, one unit per call; True when it did work (the audit)
        self.idle_task = idle_task
        self._queue: queue.Queue[WorkerRequest | None] = queue.Queue()
        self._is_stopping = False  # stop(): the running job gives up at its next layer or token, queued ones at once
        self._num_waiting = 0
        self._num_running = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return self._num_running

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._is_stopping = True
        self._queue.put(None)
        self._thread.join(timeout=30)

    def submit(self, job: WorkerRequest) -> None:
        with self._lock:
            if self._num_waiting + self._num_running >= self.max_requests:
                raise QueueFull(f"this replica already holds {self.max_requests} requests")
            self._num_waiting += 1
        self._queue.put(job)

    def _next_job(self) -> WorkerRequest | None:
        """The next request (None: stop); while none waits, the idle task runs between polls."""
        while True:
            if self.idle_task is not None and self._queue.empty():
                try:
                    if self.idle_task():
                        continue  # more idle work may be pending: look at the queue again first
                except Exception:
                    log.exception("the worker's idle task failed")
            try:
                return self._queue.get(timeout=IDLE_POLL_S if self.idle_task is not None else None)
            except queue.Empty:
                continue

    def _run(self) -> None:
        if self.first_task is not None:
            self.first_task()
        while True:
            job = self._next_job()
            if job is None:
                return
            with self._lock:
                self._num_waiting -= 1
                self._num_running += 1
            job.started_s = time.perf_counter()
            is_cancelled = lambda job=job: job.is_cancelled or self._is_stopping or _is_gone(job)  # noqa: E731
            try:
                if not is_cancelled():
                    options = replace(job.options, is_cancelled=is_cancelled) if job.options is not None else None
                    events = self.engine.generate(job.prompt_ids, job.params, options)
                    try:
                        for i, event in enumerate(events):
                            job.post(event)
                            if i == 0:
                                job.first_written.wait(FIRST_WRITE_WAIT_S)
                            if is_cancelled():
                                break
                    finally:
                        events.close()  # runs the engine's clean-up (leases, stores) on a cancel too
                job.post(_gone_error() if _is_gone(job) else _DONE)
            except RequestCancelled as exc:  # its client left, or the replica stops: not an engine failure
                log.info("%s", exc)
                job.post(_gone_error() if _is_gone(job) else exc)
            except Exception as exc:  # reported to that request only; the worker keeps serving
                log.exception("engine failed on a request")
                job.post(exc)
            finally:
                with self._lock:
                    self._num_running -= 1


def _is_gone(job: WorkerRequest) -> bool:
    return job.client_gone is not None and job.client_gone()


def _gone_error() -> ConnectionResetError:
    """What the handler of a job whose client left reads instead of the end: what its next write would raise."""
    return ConnectionResetError("the client went away")
