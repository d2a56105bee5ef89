"""A benchmark's cluster as child processes: one pool, a router and two replicas, A and B; started, waited for, stopped.

Two layouts:
  together    ``python -m kvshare up --replicas 2``: A (replica0) and B (replica1) up at once;
  sequential  ``kvshare pool``, ``kvshare route`` and one ``kvshare serve`` at a time: ``phase("A")`` starts A,
              ``phase("B")`` stops A and starts B in its place against the same pool, so B never saw A's
              prompts. For models of which two replicas do not fit one GPU (the 32B shape on an H200).

Either way the router is ``router`` (round robin over A and B), the replicas are ``urls["A"]`` and ``urls["B"]``
(router port + 1 and + 2) and the pool's socket is ``pool_socket`` once started. Used by service_ttft_gpu.py
and deterministic_service_gpu.py: run from a script in this folder (its directory is on sys.path).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from kvshare.launch import free_port_block, health_answer

LAYOUTS = ("together", "sequential")
PHASES = ("A", "B")


@dataclass(frozen=True)
class ClusterSpec:
    """What a cluster runs; ``replica_args`` are every replica's serve arguments past model, device, pool, port."""

    layout: str
    model: str
    device: str
    pool_size: str  # bytes or a size ("48GiB")
    replica_args: tuple[str, ...] = ()
    pool_args: tuple[str, ...] = ()  # the pool's arguments past its size and socket (e.g. --extent-size=1GiB)
    policy: str = "round_robin"
    start_timeout_s: float = 300.0  # kvshare up, or one replica of the sequential layout
    log_dir: str | None = None  # each child's output to NAME.log there; None: printed as "[NAME] line"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {self.layout!r}")


class Cluster:
    """The child processes of one ``ClusterSpec``: ``start()``, then ``phase("A")`` / ``phase("B")``, then
    ``stop()``."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.port = free_port_block(1 + len(PHASES))
        self.router = f"http://127.0.0.1:{self.port}"
        self.urls = {name: f"http://127.0.0.1:{self.port + 1 + i}" for i, name in enumerate(PHASES)}
        self.pool_socket: str | None = None
        self.commands: dict[str, list[str]] = {}  # child name -> its argv (the last one started under that name)
        self.procs: dict[str, subprocess.Popen] = {}
        self.lines: dict[str, list[str]] = {}  # child name -> its last output lines
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- life cycle ---------------------------------------------------------------------------------------

    def start(self) -> Cluster:
        """together: kvshare up, until router, replicas and pool answer; sequential: the pool and the router."""
        s = self.spec
        if s.layout == "together":
            self._spawn(
                "up",
                [
                    "up",
                    "--model",
                    s.model,
                    "--device",
                    s.device,
                    "--replicas",
                    "2",
                    "--policy",
                    s.policy,
                    "--port",
                    str(self.port),
                    "--pool-size",
                    str(s.pool_size),
                    *[f"--replica-arg={a}" for a in s.replica_args],
                    *[f"--pool-arg={a}" for a in s.pool_args],
                ],
            )
            self._wait_ready(
                [self.router, *self.urls.values()],
                ["up"],
                s.start_timeout_s,
                until=lambda: self.pool_socket is not None,
            )
            return self
        from kvshare.pool.spawn import wait_for_pool

        self._tmp = tempfile.TemporaryDirectory(prefix="kvshare-bench-")
        sock = os.path.join(self._tmp.name, "pool.sock")
        self._spawn("pool", ["pool", "--size", str(s.pool_size), "--socket", sock, *s.pool_args])
        wait_for_pool(sock, timeout_s=120, proc=self.procs["pool"])
        self.pool_socket = sock
        self._spawn(
            "router",
            [
                "route",
                "--policy",
                s.policy,
                "--port",
                str(self.port),
                "--replica",
                self.urls["A"],
                "--replica",
                self.urls["B"],
            ],
        )
        return self

    def phase(self, name: str) -> None:
        """Sequential: replica ``name`` up in place of the other (same pool, same arguments); together: a no-op."""
        if name not in PHASES:
            raise ValueError(f"a phase is one of {', '.join(PHASES)}; got {name!r}")
        s = self.spec
        if s.layout == "together":
            return
        for other in PHASES:
            if other != name:
                self._stop(other)
        port = self.port + 1 + PHASES.index(name)
        self._spawn(
            name,
            [
                "serve",
                "--model",
                s.model,
                "--device",
                s.device,
                "--pool",
                self.pool_socket,
                "--provenance",
                "all",
                *s.replica_args,
                "--port",
                str(port),
                "--replica-name",
                f"replica-{name}",
            ],
        )
        self._wait_ready([self.urls[name]], [name], s.start_timeout_s)
        self._wait_ready([self.router], ["router"], 30.0)
        time.sleep(2.5)  # the router's health loop (1 s) has seen the replica that went and the one that came

    def stop(self) -> None:
        """Every child, kvshare up first (it stops its own pool, replicas and router)."""
        for name in ("up", "router", *PHASES, "pool"):
            self._stop(name)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- children -----------------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        command = [sys.executable, "-m", "kvshare", *argv]
        print("$ " + " ".join(command), flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="1000")  # up prints through rich: no wrapped lines
        if argv[0] == "serve" and self.spec.device == "cpu":  # as kvshare up does: a replica's share of the cores
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
        self.commands[name], self.procs[name], self.lines[name] = command, proc, []
        threading.Thread(target=self._read, args=(name, proc), daemon=True).start()
        return proc

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        log = open(os.path.join(self.spec.log_dir, f"{name}.log"), "a") if self.spec.log_dir else None
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                lines = self.lines[name]
                lines.append(line)
                del lines[:-200]
                if log is not None:
                    log.write(line + "\n")
                    log.flush()
                else:
                    print(f"[{name}] {line}", flush=True)
                m = re.match(r"\s*pool: (\S+)", line) if name == "up" else None
                if m and m.group(1) != "off":
                    self.pool_socket = m.group(1)
        finally:
            if log is not None:
                log.close()

    def _wait_ready(self, urls: list[str], names: list[str], timeout_s: float, until=lambda: True) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for name in names:
                if self.procs[name].poll() is not None:
                    raise RuntimeError(
                        f"{name} exited {self.procs[name].returncode} before {urls} were ready:\n"
                        + "\n".join(self.lines[name][-30:])
                    )
            if until() and all(health_answer(u, None, 5.0) == "ready" for u in urls):
                return
            if time.monotonic() > deadline:
                tail = "\n".join(line for n in names for line in self.lines[n][-30:])
                raise TimeoutError(f"{urls} were not ready within {timeout_s:.0f} s:\n{tail}")
            time.sleep(0.5)

    def _stop(self, name: str, timeout_s: float = 90.0) -> None:
        """SIGTERM (kvshare up: SIGINT, as Ctrl-C), then SIGKILL to the child's process group after ``timeout_s``."""
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT if name == "up" else signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        print(f"{name} stopped (exit {proc.returncode})", flush=True)
