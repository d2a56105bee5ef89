"""When waiting for the other end of the pool socket spins, and when it sleeps in the kernel.

A cross-core wake-up costs ~30 us on the VMs measured, so a waiter that polls
the socket without sleeping sees a reply that comes soon sooner. That only
pays while the other end runs on another core that nothing else wants. When
the cores are oversubscribed (a replica's tokenizer and scheduler beside the
pool on a 2-core host), a spinning client and a busy-polling daemon wait each
other out: each spin holds a core the reply needs, and a task that spins uses
its fair share of the CPU, so the scheduler no longer favours it when it wakes.
A task that sleeps at once uses little CPU and is eligible to run before the
busy ones when its message comes. So a wait spins only while

- no task waits for a core (``CpuPressure``: the share of the last interval in
  which some runnable task waited, Linux PSI), and
- spinning paid lately: fewer than ``MAX_MISSES`` waits in a row whose answer
  came after the window (a slow request, a remote-tier lookup), probed again
  every ``PROBE_EVERY`` waits so it spins again when the answers are quick.

Yielding the core between polls (sched_yield) was tried and lost: with busy
neighbours the yield hands a whole time slice to one of them (lookup + lease +
release 370-500/s against 1.1-2.1k/s without it, two burners, 2 cores).

What bounds the rate once neither end spins (2026-12-05, 2-core VM, kernel 6.18,
benchmarks/pool_contention.py with two burners, /proc/PID/schedstat and perf sched):
the kernel puts the client and the daemon either together on one core and both
burners on the other (~10k/s, p99 ~160 us: bound by the pair's CPU per round
trip, ~95 us of Python, syscalls and switches), or each beside a burner
(~6-7k/s, p50 ~60 us, p99 ~3 ms): a sleeper keeps the negative lag of the CPU it
used (EEVDF), so each waited about as long as it ran (35 us run, 34 us wait a
round trip), and the slowest waits last about a burner's time slice. A shorter
slice (sched_setattr's sched_runtime, 100 or 500 us, on the daemon alone or on
both ends) changed neither mode: contended 6.0-9.7k/s with it, 6.1-9.7k/s
without. A shortened slice lets a woken task preempt a busy one only when it is
eligible (no negative lag), and an end that has just run for its part of the
round trip is not, so it still waits for the burner's slice to end at a tick
(4 ms at HZ=250). A higher weight for the daemon (nice -10, which needs
CAP_SYS_NICE) gave ~10k/s with p99 1.6-2 ms: the client's waits remain. Only
less CPU per round trip raises the rate. How much less: a C ping-pong over a
unix socket pair beside the same two burners kept its p99 at 27-80 us while the
client spent at most 15 us a round trip (the other end up to 30 us), passed
20k/s only at ~5 us a side (18.9k/s at 8 us), and reached p99 1.8-3.6 ms once the client
spent 20-40 us. A Python client's part is ~40 us, so lookups of committed
chains take no round trip at all (direct.py): a pure-Python loop of 20-40 us
steps beside the same two burners kept p99 under 50 us (it is preempted only at
ticks, ~4 ms apart), and direct lookups run at 27-29k/s, p99 37-47 us there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

MAX_MISSES = 4
PROBE_EVERY = 64
PSI_CPU_PATH = "/proc/pressure/cpu"
# Waiting for a core more than this share of the time: the cores are oversubscribed and a spin takes a core
# that a runnable task (maybe the other end) wants. Quiet 2-core VM with the pool busy: under 2 %; two burners
# beside it: 70-99 % (benchmarks/pool_contention.py).
CONTENDED_SHARE = 0.10
PRESSURE_INTERVAL_S = 0.05  # how stale a pressure reading may be (one /proc read per interval: ~30 us)


class CpuPressure:
    """Whether runnable tasks waited for a core lately: PSI "some" over the last interval (no PSI: never)."""

    def __init__(
        self,
        path: str = PSI_CPU_PATH,
        interval_s: float = PRESSURE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self._clock = clock
        self._has_psi = os.path.exists(path)  # without PSI only the misses decide
        self._read_at = clock()
        self._waited_us = self._read_waited_us() if self._has_psi else 0
        self._is_contended = False

    def _read_waited_us(self) -> int:
        """The "some" line's total: microseconds in which some runnable task waited for a core."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                text = os.read(fd, 256)
            finally:
                os.close(fd)
            line = text[: text.index(b"\n")]
            return int(line[line.rindex(b"total=") + 6 :])
        except (OSError, ValueError):
            return self._waited_us

    def is_contended(self) -> bool:
        now = self._clock()
        elapsed_s = now - self._read_at
        if not self._has_psi or elapsed_s < self.interval_s:
            return self._is_contended
        waited_us = self._read_waited_us()
        self._is_contended = (waited_us - self._waited_us) * 1e-6 > CONTENDED_SHARE * elapsed_s
        self._read_at, self._waited_us = now, waited_us
        return self._is_contended


class SpinPolicy:
    """The spin window of each wait (the caller reports whether the answer came within it).

    ``is_contended``: whether the cores are oversubscribed now (``CpuPressure.is_contended``); then no wait spins.
    """

    def __init__(self, spin_s: float, is_contended: Callable[[], bool] = lambda: False) -> None:
        self.spin_s = spin_s
        self._is_contended = is_contended
        self._num_misses = 0  # waits in a row whose answer came after the window
        self._num_waits = 0

    def window_s(self) -> float:
        """How long the next wait may spin before it sleeps (0: sleep at once)."""
        if self.spin_s <= 0 or self._is_contended():
            return 0.0
        self._num_waits += 1
        is_paying = self._num_misses < MAX_MISSES
        return self.spin_s if is_paying or self._num_waits % PROBE_EVERY == 0 else 0.0

    def record(self, is_within_window: bool) -> None:
        """Whether the answer the last wait got came within its spin window."""
        self._num_misses = 0 if is_within_window else min(self._num_misses + 1, MAX_MISSES)
