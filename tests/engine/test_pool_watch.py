"""The engine's pool link watches the pool without waiting for a request: it notices a pool that died,
connects to a new one at the same socket, and reports either state (kvshare_pool_connected, /health)."""

from __future__ import annotations

import os
import signal

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine
from kvshare.pool.spawn import start_pool, stop_process
from tests.reliability.conftest import wait_until

POOL_ARGS = ("--extent-size", "8MiB")


def test_a_killed_pool_is_noticed_and_its_replacement_connected_without_a_request(tiny_dir, tmp_path):
    os.chmod(tmp_path, 0o700)
    socket_path = str(tmp_path / "pool.sock")
    pool = start_pool(socket_path, "32MiB", POOL_ARGS, log_level="WARNING")
    engine = Engine(
        EngineConfig(model=tiny_dir, chunk_tokens=16, pool_socket=socket_path, pool_retry_s=0.05, pool_retry_max_s=0.2)
    )
    try:
        assert engine.stats().is_pool_configured and engine.stats().is_pool_connected
        os.kill(pool.pid, signal.SIGKILL)
        pool.wait()
        wait_until(lambda: not engine.stats().is_pool_connected, 10, "the link to notice the pool died")
        pool = start_pool(socket_path, "32MiB", POOL_ARGS, log_level="WARNING")
        wait_until(lambda: engine.stats().is_pool_connected, 10, "the link to connect to the new pool")
        assert engine.stats().pool_connects == 2 and engine.stats().num_requests == 0
    finally:
        engine.close()
        stop_process(pool)


def test_an_engine_without_a_pool_reports_none():
    assert not Engine(EngineConfig(model="tiny")).stats().is_pool_configured
