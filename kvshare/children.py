"""The child processes of ``kvshare up``: how each is started (and started again), and what it last wrote.

A child runs in its own session (a Ctrl-C at the terminal reaches only ``up``, which stops the
children in order) and gets SIGTERM from the kernel when the thread that started it ends
(PR_SET_PDEATHSIG follows the thread, not the process): start children from one long-lived
thread, the main one. Its stderr is a pipe that a thread copies, line by line and prefixed with
the child's name, to this process's stderr, keeping the last lines for the message that says why
it stopped.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO

from kvshare.memory_fit import oom_hint

_PR_SET_PDEATHSIG = 1
NUM_TAIL_LINES = 20


@dataclass(frozen=True)
class ChildSpec:
    """Everything needed to start one child, the first time or after it died."""

    name: str  # "pool", "replica0", ..., "router"
    argv: tuple[str, ...]
    env: Mapping[str, str] | None = None  # None: this process's environment
    url: str | None = None  # an HTTP child: ready when URL/health answers 200
    takes_instance_id: bool = False  # kvshare serve/route: started with --instance-id ID, reported by /health


@dataclass
class Child:
    """One started process of a ChildSpec."""

    spec: ChildSpec
    proc: subprocess.Popen
    instance_id: str | None  # what its /health must report, when the spec takes one
    output: OutputTail


def start_child(spec: ChildSpec, is_verbose: bool = False) -> Child:
    """Start ``spec`` (with a fresh instance id when it takes one); stdout is kept only when ``is_verbose``."""
    argv = list(spec.argv)
    instance_id = None
    if spec.takes_instance_id:
        instance_id = secrets.token_hex(8)
        argv += ["--instance-id", instance_id]
    proc = subprocess.Popen(
        argv,
        stdout=None if is_verbose else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent,
        env=dict(spec.env) if spec.env is not None else None,
    )
    return Child(spec, proc, instance_id, OutputTail(proc.stderr, f"{spec.name}| "))


def describe_exit(returncode: int, oom_kills_before: int | None = None) -> str:
    """``exit code 2`` or ``killed by SIGKILL`` (Popen reports a signal as a negative code); a SIGKILL while the
    kernel's OOM killer ended a process since ``oom_kills_before`` (kvshare.memory_fit.oom_kills) says so, with
    the memory left."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}{oom_hint(returncode, oom_kills_before)}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class OutputTail:
    """Copies a child's stderr to this process's fd 2 as it comes; keeps the last ``num_lines`` lines."""

    def __init__(self, stream: IO[bytes], prefix: str, num_lines: int = NUM_TAIL_LINES, sink_fd: int = 2) -> None:
        self._stream = stream
        self._prefix = prefix.encode()
        self._sink_fd = sink_fd
        self._lines: collections.deque[str] = collections.deque(maxlen=num_lines)
        self._thread = threading.Thread(target=self._copy, name=f"output {prefix.strip()}", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        with self._stream:
            for line in iter(self._stream.readline, b""):
                self._lines.append(line.decode(errors="replace").rstrip("\n"))
                try:
                    os.write(self._sink_fd, self._prefix + line)
                except OSError:  # our stderr went away: keep the tail anyway
                    pass

    def lines(self, timeout_s: float = 2.0) -> list[str]:
        """The last lines, after waiting up to ``timeout_s`` for the child's stderr to end (it exited)."""
        self._thread.join(timeout_s)
        return list(self._lines)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def health_answer(url: str, instance_id: str | None, timeout_s: float = 2.0) -> str:
    """``ready`` when ``url``/health answers 200 (as ``instance_id``, when given); ``other`` when another
    server answers in its place; ``no`` otherwise."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
            if resp.status != 200:
                return "no"
            if instance_id is None:
                return "ready"
            body = json.loads(resp.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return "no"
    return "ready" if isinstance(body, dict) and body.get("instance_id") == instance_id else "other"


def wait_http_ready(
    url: str,
    proc: subprocess.Popen | None,
    timeout_s: float,
    name: str = "the server",
    instance_id: str | None = None,
    oom_kills_before: int | None = None,
) -> None:
    """Poll ``url``/health until it answers 200 (as ``instance_id``, when given: the process just started, not
    another that holds the port); raise if ``proc`` exits first (described as describe_exit does, from
    ``oom_kills_before``) or time runs out."""
    deadline = time.monotonic() + timeout_s
    other = ""
    while True:
        if proc is not None and proc.poll() is not None:
            how = describe_exit(proc.returncode, oom_kills_before)
            raise RuntimeError(f"{name} at {url} exited ({how}) before it was ready{other}")
        answer = health_answer(url, instance_id)
        if answer == "ready":
            return
        if answer == "other":
            other = f"; another server answers at {url} (not the {name} just started): its port is taken"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} at {url} was not ready within {timeout_s} s{other}")
        time.sleep(0.2)


def stop_group(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Ends ``proc``'s process group (a server started with start_new_session and its workers): SIGTERM, then
    SIGKILL after ``timeout_s``; returns once ``proc`` has exited."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
