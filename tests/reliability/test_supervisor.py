"""`kvshare up` keeps its cluster up (real processes, a client loop through the router):

- kill -9 of a replica, of the pool and of the router: `up` starts each again; after the failover
  window every request succeeds, and every answer (temperature 0) is the one given before any kill;
  after the pool's restart the replicas share KV through the new pool again;
- a child that keeps dying crash-loops: `up` stops everything and exits 1 naming it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from kvshare.launch import free_port_block
from tests.reliability.conftest import report, wait_until
from tests.serve.up_process import UpProcess, get_json

pytestmark = pytest.mark.reliability
PROMPTS = [f"request {i} of the loop keeps asking the same thing. " * 4 for i in range(4)]
SHARED = "a long prefix that one replica computes and the other loads from the pool. " * 10  # ~760 tokens


def complete(url: str, prompt: str, timeout: float = 60) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class ClientLoop:
    """One client sending PROMPTS round and round; records (start, end, ok, answer is the reference)."""

    def __init__(self, url: str, reference: dict[str, str]) -> None:
        self.url, self.reference = url, reference
        self.records: list[tuple[float, float, bool, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            start = time.monotonic()
            try:
                text = complete(self.url, prompt)["choices"][0]["text"]
                self.records.append((start, time.monotonic(), True, text == self.reference[prompt]))
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                self.records.append((start, time.monotonic(), False, True))
                time.sleep(0.2)
            i += 1

    def num_ok_since(self, t: float) -> int:
        return sum(1 for start, _end, ok, _same in self.records if start >= t and ok)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(90)


def replaced(up: UpProcess, name: str, old_pid: int) -> psutil.Process | None:
    child = up.child(name)
    return child if child is not None and child.pid != old_pid else None


def test_up_restarts_a_killed_replica_pool_and_router_and_answers_stay_the_same(tmp_path):
    up = UpProcess("--replicas", "2", "--pool-size", "64MiB", cwd=tmp_path, port=free_port_block(3))
    replica_urls = [f"http://127.0.0.1:{up.port + 1 + i}" for i in range(2)]
    windows = {}
    try:
        up.wait_ready(2)
        reference = {p: complete(up.router_url, p)["choices"][0]["text"] for p in PROMPTS}
        loop = ClientLoop(up.router_url, reference)
        for name in ("replica1", "pool", "router"):
            victim = up.child(name)
            killed = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            wait_until(lambda: replaced(up, name, victim.pid), 60, f"up to start {name} again", interval_s=0.2)
            if name == "pool":  # both replicas reconnect to the new pool without a request and share through it
                wait_until(
                    lambda: all(get_json(u + "/health")[1].get("pool") == "connected" for u in replica_urls),
                    60,
                    "the replicas to reconnect to the new pool",
                )
            up.wait_ready(2, timeout_s=120)
            back = time.monotonic()
            wait_until(lambda: loop.num_ok_since(back) >= 4, 120, f"requests to succeed after {name} came back")
            windows[name] = (killed, back)
        prompt = SHARED + "after the pool's restart"
        assert complete(replica_urls[0], prompt)["kvshare"]["pool_tokens"] == 0
        assert complete(replica_urls[1], prompt)["kvshare"]["pool_tokens"] >= 512  # through the new pool
        loop.stop()
        assert up.proc.poll() is None, up.output()
        for line in (
            "replica1 exited (killed by SIGKILL); starting it again",
            "pool exited (killed by SIGKILL)",
            "router exited (killed by SIGKILL)",
            "replica1 is back",
            "pool is back",
            "router is back",
        ):
            assert line in up.output(), up.output()
        records = loop.records
        assert all(same for *_x, ok, same in records if ok), "an answer changed"
        # a request failed only within a failover window (from just before a kill until the cluster was whole)
        failed = [r for r in records if not r[2]]
        assert not [r for r in failed if not any(k - 1 <= r[0] <= b for k, b in windows.values())], (windows, failed)
        report(
            "up supervises: kill -9 replica, pool, router",
            requests=len(records),
            failed={name: sum(1 for r in failed if k - 1 <= r[0] <= b) for name, (k, b) in windows.items()},
            failover_s={name: round(b - k, 1) for name, (k, b) in windows.items()},
        )
    finally:
        children = up.descendants()
        rc = up.stop()
    assert rc == 0, up.output()
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_child_that_keeps_dying_crash_loops_and_up_exits_1_naming_it(tmp_path):
    up = UpProcess(
        "--replicas",
        "1",
        "--pool-size",
        "64MiB",
        "--max-restarts",
        "2",
        "--restart-window",
        "120",
        cwd=tmp_path,
        port=free_port_block(2),
    )
    try:
        up.wait_ready(1)
        children = up.descendants()
        pid = up.child("replica0").pid
        for _ in range(3):  # the first exit and two restarts; the third death is one too many
            os.kill(pid, signal.SIGKILL)
            if _ < 2:
                pid = wait_until(lambda: replaced(up, "replica0", pid), 60, "a restart", interval_s=0.05).pid
        rc = up.proc.wait(60)
    finally:
        up.stop()
    out = up.output()
    assert rc == 1, out
    assert (
        "replica0 crash-looped: it exited 3 times within 120 s (--max-restarts 2; the last exit: killed by "
        "SIGKILL); its last lines:"
    ) in out
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
