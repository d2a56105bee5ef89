"""A real ``kvshare up`` process for tests: started as a user starts it, its children found by their command lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil

from kvshare.pool.spawn import kvshare_env


def get_json(url: str, timeout: float = 10) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


class UpProcess:
    """``python -P -m kvshare up --port PORT ARGS...`` in ``cwd``; its output goes to ``cwd/up.log``."""

    def __init__(self, *args: str, cwd, port: int) -> None:
        self.port = port
        self.router_url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(cwd, "up.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "kvshare", "up", "--port", str(port), *args],
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=kvshare_env(),
                start_new_session=True,
            )

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, num_replicas: int, timeout_s: float = 240) -> dict:
        """Until the router answers with every replica healthy and ``up`` has announced the started cluster (a signal
        before that interrupts the start: exit 130); the router's /health."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"up exited with {self.proc.returncode}:\n{self.output()}"
            status, health = get_json(self.router_url + "/health", timeout=2)
            replicas = health.get("replicas", [])
            is_healthy = status == 200 and len(replicas) == num_replicas and all(r["healthy"] for r in replicas)
            if is_healthy and "kvshare up: router" in self.output():
                return health
            assert time.monotonic() < deadline, f"up was not ready within {timeout_s} s:\n{self.output()}"
            time.sleep(0.3)

    def child(self, name: str) -> psutil.Process | None:
        """The live child ``pool``, ``replicaN`` or ``router``, by its command line."""
        for proc in psutil.Process(self.proc.pid).children():
            try:
                argv = proc.cmdline()
            except psutil.NoSuchProcess:
                continue
            if proc.status() == psutil.STATUS_ZOMBIE or "kvshare" not in argv:
                continue
            command = argv[argv.index("kvshare") + 3] if len(argv) > argv.index("kvshare") + 3 else ""
            if (command, name) in (("pool", "pool"), ("route", "router")):
                return proc
            if command == "serve" and argv[argv.index("--replica-name") + 1] == name:
                return proc
        return None

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM (as Ctrl-C would), then its exit code; SIGKILL to the group if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"up did not stop within {timeout_s} s:\n{self.output()}") from None
