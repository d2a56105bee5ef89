"""`kvshare serve --pool SOCKET` where nobody listens: the replica serves cold and says so (/health, a gauge,
a warning repeated with backoff), then connects by itself once a pool listens there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request

from kvshare.launch import free_port_block
from kvshare.pool.spawn import kvshare_env, start_pool, stop_process
from tests.reliability.conftest import wait_until
from tests.serve.up_process import get_json


def gauge(url: str, name: str) -> float | None:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name]
    return values[0] if values else None


def test_serve_with_an_unreachable_pool_says_so_and_connects_when_one_listens(tmp_path):
    os.chmod(tmp_path, 0o700)
    socket_path = str(tmp_path / "pool.sock")
    port = free_port_block(1)
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        replica = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "kvshare",
                "serve",
                "--port",
                str(port),
                "--pool",
                socket_path,
                "--instance-id",
                "r-1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=kvshare_env(),
        )
    pool = None
    try:
        wait_until(
            lambda: get_json(url + "/health", timeout=2)[0] == 200 or replica.poll() is not None,
            180,
            "the replica to answer",
        )
        status, health = get_json(url + "/health")
        assert status == 200 and health["pool"] == "unreachable" and health["instance_id"] == "r-1"
        assert gauge(url, "kvshare_pool_connected") == 0
        tries = lambda: re.findall(
            r"the pool at \S+ is unreachable .*; serving without it; next try in ([0-9.]+) s", log_path.read_text()
        )
        wait_until(lambda: len(tries()) >= 3, 30, "the warning to repeat")  # without any request
        delays = [float(d) for d in tries()]
        assert delays[:3] == sorted(delays[:3]) and delays[2] > delays[0], delays  # backoff
        assert socket_path in log_path.read_text()

        pool = start_pool(socket_path, "64MiB", log_level="WARNING")
        wait_until(lambda: get_json(url + "/health")[1].get("pool") == "connected", 60, "the replica to connect")
        assert gauge(url, "kvshare_pool_connected") == 1
    finally:
        replica.terminate()
        replica.wait(60)
        if pool is not None:
            stop_process(pool)
