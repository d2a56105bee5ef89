"""`python -m kvshare up` as a child process of a benchmark: started, waited for, stopped.

Used by benchmarks/deterministic_service_gpu.py; run from a script in this folder (its directory is on
sys.path), or loaded with it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from kvshare.launch import free_port_block, health_answer


class UpCluster:
    """`python -m kvshare up UP_ARGS --replicas N --port P` as a child process; ready when its router and
    replicas answer /health and it printed its pool; stopped with SIGTERM (up stops pool, replicas, router)."""

    def __init__(self, up_args: list[str], num_replicas: int = 2) -> None:
        self.port = free_port_block(1 + num_replicas)
        self.router = f"http://127.0.0.1:{self.port}"
        self.replicas = [f"http://127.0.0.1:{self.port + 1 + i}" for i in range(num_replicas)]
        self.command = [sys.executable, "-m", "kvshare", "up", *up_args, "--replicas", str(num_replicas),
                        "--port", str(self.port)]
        self.lines: list[str] = []
        self.pool_socket: str | None = None
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> "UpCluster":
        print("$ " + " ".join(self.command), flush=True)
        env = dict(os.environ, COLUMNS="1000")  # up prints through rich: no wrapped lines
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvshare up exited {self.proc.returncode}:\n" + "\n".join(self.lines[-30:]))
            if self.pool_socket and all(health_answer(u, None, 5.0) == "ready" for u in (self.router, *self.replicas)):
                return self
            time.sleep(1.0)
        raise TimeoutError(f"kvshare up not ready within {timeout_s:.0f} s:\n" + "\n".join(self.lines[-30:]))

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            print(f"[up] {line}", flush=True)
            m = re.match(r"\s*pool: (\S+)", line)
            if m and m.group(1) != "off":
                self.pool_socket = m.group(1)

    def stop(self, timeout_s: float = 90.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:  # up did not stop its children in time: end the whole group
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        print(f"kvshare up stopped (exit {self.proc.returncode})", flush=True)
