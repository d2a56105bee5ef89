"""``kvshare up`` as a supervisor: a child that dies is started again, with backoff, unless it crash-loops.

    a child exits     -> its exit is counted
    > max_restarts exits within window_s  -> CrashLoop: up stops everything and exits 1
    otherwise         -> started again after backoff_s * 2 ** (exits in the window - 1), at most backoff_max_s

A restarted replica rejoins by itself: the router's health loop sends it requests again once its
/health answers, and replicas reconnect to a restarted pool (same socket path) with their own
backoff. A child that exits before it was first ready stops ``up`` at once instead
(kvshare.launch.Cluster.start): a start-up error (a bad flag, a model that does not load) does not
go away by retrying.

Ctrl-C and SIGTERM (``StopSignals``) end the supervision loop once the cluster is up; while it still starts they
interrupt the start, which stops what has started.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvshare import memory_fit
from kvshare.children import describe_exit


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead child is started again (``up --max-restarts N --restart-window S``)."""

    max_restarts: int = 5  # restarts allowed within window_s; one more exit there is a crash loop
    window_s: float = 60.0
    backoff_s: float = 0.5  # the first restart's delay; doubles with each exit in the window
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.window_s <= 0 or self.backoff_s <= 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("--restart-window and the backoff must be positive (backoff_max_s >= backoff_s)")


def restart_delay(exit_times: Sequence[float], now: float, policy: RestartPolicy) -> float | None:
    """Seconds until a child whose exits happened at ``exit_times`` (the last one now) is started again.

    None: it crash-loops (more than ``policy.max_restarts`` exits within ``policy.window_s``).
    """
    num_recent = sum(1 for t in exit_times if now - t <= policy.window_s)
    if num_recent > policy.max_restarts:
        return None
    return min(policy.backoff_s * 2 ** (num_recent - 1), policy.backoff_max_s)


class CrashLoop(Exception):
    """A child exited more often than the restart policy allows; the message says which, how and what it wrote."""

    def __init__(
        self,
        name: str,
        returncode: int,
        num_exits: int,
        policy: RestartPolicy,
        tail: list[str],
        oom_kills_before: int | None = None,
    ) -> None:
        self.name, self.returncode = name, returncode
        lines = "\n".join(f"  {line}" for line in tail) or "  (it wrote nothing to stderr)"
        super().__init__(
            f"{name} crash-looped: it exited {num_exits} times within {policy.window_s:g} s "
            f"(--max-restarts {policy.max_restarts}; the last exit: {describe_exit(returncode, oom_kills_before)}); "
            f"its last lines:\n{lines}"
        )


class Supervised(Protocol):
    """What the supervisor needs of a cluster (kvshare.launch.Cluster)."""

    processes: dict  # name -> subprocess.Popen

    def restart(self, name: str) -> None: ...
    def is_ready(self, name: str) -> bool: ...
    def output_lines(self, name: str) -> list[str]: ...


@dataclass
class Supervisor:
    """Call ``poll()`` every fraction of a second from the thread that started the cluster."""

    cluster: Supervised
    policy: RestartPolicy = RestartPolicy()
    ready_timeout_s: float = 300.0  # a restarted child not ready by then is killed (and counted as an exit)
    say: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    num_restarts: dict[str, int] = field(default_factory=dict)
    _exits: dict[str, list[float]] = field(default_factory=dict)
    _restart_at: dict[str, float] = field(default_factory=dict)  # dead children waiting out their backoff
    _starting: dict[str, float] = field(default_factory=dict)  # restarted, not ready yet: name -> deadline
    # the kernel's OOM kills before the last exit seen, so the next one says whether the OOM killer ended it
    oom_kills_before: int | None = field(default_factory=lambda: memory_fit.oom_kills())
    _killed: set[str] = field(default_factory=set)  # children this supervisor killed: the OOM killer did not

    def poll(self) -> None:
        """Note exits, start again those whose backoff is over, report those ready again; raises CrashLoop."""
        now = self.clock()
        for name, proc in list(self.cluster.processes.items()):
            if name not in self._restart_at and proc.poll() is not None:
                self._exited(name, proc.returncode, now)
        for name, at in list(self._restart_at.items()):
            if now >= at:
                del self._restart_at[name]
                self.cluster.restart(name)
                self.num_restarts[name] = self.num_restarts.get(name, 0) + 1
                self._starting[name] = now + self.ready_timeout_s
        for name, deadline in list(self._starting.items()):
            proc = self.cluster.processes[name]
            if proc.poll() is not None:
                del self._starting[name]  # counted at the next poll
            elif self.cluster.is_ready(name):
                del self._starting[name]
                self.say(f"{name} is back (restart {self.num_restarts[name]})")
            elif now > deadline:
                del self._starting[name]
                self.say(f"{name} was not ready {self.ready_timeout_s:g} s after its restart; killing it")
                proc.kill()
                self._killed.add(name)

    def _exited(self, name: str, returncode: int, now: float) -> None:
        self._starting.pop(name, None)
        oom_kills_before = None if name in self._killed else self.oom_kills_before
        self._killed.discard(name)
        self.oom_kills_before = memory_fit.oom_kills()
        exits = self._exits.setdefault(name, [])
        exits.append(now)
        delay = restart_delay(exits, now, self.policy)
        if delay is None:
            num_recent = sum(1 for t in exits if now - t <= self.policy.window_s)
            tail = self.cluster.output_lines(name)
            raise CrashLoop(name, returncode, num_recent, self.policy, tail, oom_kills_before)
        self.say(f"{name} exited ({describe_exit(returncode, oom_kills_before)}); starting it again in {delay:g} s")
        self._restart_at[name] = now + delay


class StopSignals:
    """Ctrl-C and SIGTERM: once the cluster is up they end the supervision loop; while it is still starting they
    interrupt the start (KeyboardInterrupt), which stops what has started."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.is_supervising = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, *_) -> None:
        is_starting = not self.stop.is_set() and not self.is_supervising
        self.stop.set()
        if is_starting:
            raise KeyboardInterrupt
