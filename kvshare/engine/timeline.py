"""A request's timeline: when each step before its first token ended, in seconds since it arrived.

Asked for with the request extension ``{"kvshare": {"timeline": true}}``; the replica fills it
(serve: body read, parse, first token written; engine: hashing, the local cache's copies, the load,
the forward, the load's check, the first token sampled, the prompt published; pool link: the lease)
and returns it in the response's ``kvshare`` object. A step that does not apply is None (no pool load: no
lease, copy, load start or end; nothing from the local cache: no local copies)::

    arrival | body_read | parse | hashing | local_copied | lookup_and_lease | first_copy_enqueued | load_started
            | load_issued | first_layer_computed | load_end | forward_end | load_checked
            | first_token_sampled | first_token_written | published

``load_started`` is when the copy stream reached the load (its copies may wait there no longer), so
``load_end - load_started`` is the load's own time on the device, whatever ran beside it; ``published``
is when the prompt's chunks were in the local cache and the pool, after the first token (a publish thread
stores them beside the decode steps).

On CUDA the device steps (local copies, load start, first layer, load end, forward end) are CUDA events,
put on the host's clock through an anchor event recorded on the idle compute stream when the prefill
starts; they are read once the request's work is done (``as_dict``). On CPU every step is the host's clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

STEPS = (
    "body_read",
    "parse",
    "hashing",
    "local_copied",
    "lookup_and_lease",
    "first_copy_enqueued",
    "load_started",
    "load_issued",
    "first_layer_computed",
    "load_end",
    "forward_end",
    "load_checked",
    "first_token_sampled",
    "first_token_written",
    "published",
)
_active = threading.local()  # the timeline of the request the current thread runs (see ``note``)


class Timeline:
    """Step -> time of one request; the first mark of a step wins, and nothing changes once read."""

    def __init__(self, arrival_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.arrival_s = arrival_s  # clock() when the request arrived
        self._clock = clock
        self._host: dict[str, float] = {}
        self._events: dict[str, Any] = {}  # step -> a timing CUDA event
        self._anchor: tuple[float, Any] | None = None  # (host time, event recorded at that time)
        self._load: Any = None  # the pool load's handle (LoadHandle)
        self._result: dict[str, float | None] | None = None

    @property
    def is_closed(self) -> bool:
        return self._result is not None

    def mark(self, step: str, at: float | None = None) -> None:
        """The host reached ``step`` now (or at ``at``, a clock() value)."""
        if step not in STEPS:
            raise ValueError(f"unknown timeline step {step!r}; steps: {', '.join(STEPS)}")
        if self._result is None and step not in self._host and step not in self._events:
            self._host[step] = self._clock() if at is None else at

    def start_device(self, device) -> None:
        """Before the prefill's first kernel: on CUDA, the anchor that puts device events on the host's clock."""
        if getattr(device, "type", "cpu") != "cuda" or self._anchor is not None:
            return
        import torch

        stream = torch.cuda.current_stream(device)
        stream.synchronize()  # idle between requests already; makes the anchor exact
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self._anchor = (self._clock(), event)

    def mark_device(self, step: str, device) -> None:
        """The device reaches ``step`` once the work enqueued so far on its current stream is done."""
        if self._anchor is None or self._result is not None:
            self.mark(step)
            return
        import torch

        if step not in self._events and step not in self._host:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            self._events[step] = event

    def layer_hook(self, before_layer: Callable[[int], None], device) -> Callable[[int], None]:
        """``before_layer`` that also marks first_layer_computed when layer 1 is about to read the cache."""

        def hook(layer: int) -> None:
            if layer == 1:
                self.mark_device("first_layer_computed", device)
            before_layer(layer)

        return hook

    def record_load(self, handle: Any) -> None:
        """A pool load was issued (its handle: first copy time, end event); CPU loads are done by now."""
        self.mark("load_issued")
        self._load = handle
        if getattr(handle, "end", None) is None:  # CPU: copied before load() returned
            self.mark("load_end")

    def as_dict(self) -> dict[str, float | None]:
        """Seconds since arrival of each step (None: did not apply). Waits for the device steps' events."""
        if self._result is None:
            if self._load is not None:
                first = getattr(self._load, "first_copy_s", None)
                if first is not None:
                    self.mark("first_copy_enqueued", first)
                start, end = getattr(self._load, "start", None), getattr(self._load, "end", None)
                if end is not None and self._anchor is not None:
                    if start is not None:
                        self._events.setdefault("load_started", start)
                    self._events.setdefault("load_end", end)
                elif first is not None:  # CPU: the copy ran when it was enqueued
                    self.mark("load_started", first)
            times = dict(self._host)
            if self._anchor is not None:
                host, anchor = self._anchor
                for step, event in self._events.items():
                    event.synchronize()
                    times[step] = host + anchor.elapsed_time(event) / 1e3
            if "first_layer_computed" not in times and "forward_end" in times:  # a one-layer model
                times["first_layer_computed"] = times["forward_end"]
            self._result = {s: (round(times[s] - self.arrival_s, 6) if s in times else None) for s in STEPS}
            self._load = None
        return dict(self._result)


@contextmanager
def active(timeline: Timeline | None) -> Iterator[None]:
    """Make ``timeline`` the current thread's for ``note`` (None: nothing to note)."""
    previous = getattr(_active, "timeline", None)
    _active.timeline = timeline
    try:
        yield
    finally:
        _active.timeline = previous


def note(step: str) -> None:
    """Mark ``step`` on the current thread's active timeline, if any (a hook for code below the engine)."""
    timeline = getattr(_active, "timeline", None)
    if timeline is not None:
        timeline.mark(step)
