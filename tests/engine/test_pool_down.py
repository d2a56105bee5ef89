"""The pool is an accelerator, never a dependency: down -> cold and counted; back -> reconnected."""

from __future__ import annotations

import os
import time

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions
from kvshare.pool.spawn import start_pool, stop_process
from tests.engine.conftest import ascii_prompt
from tests.engine.test_reuse import COLD, run

CHUNK = 16
NO_LOCAL = RequestOptions(use_local_cache=False)
POOL_ARGS = ("--extent-size", "8MiB")


def _engine(tiny_dir: str, socket_path: str) -> Engine:
    return Engine(
        EngineConfig(
            model=tiny_dir,
            chunk_tokens=CHUNK,
            pool_socket=socket_path,
            verify_checksums=True,
            pool_retry_s=0.05,
            pool_retry_max_s=0.2,
        )
    )


def test_no_pool_means_cold(tiny_dir, tmp_path):
    engine = _engine(tiny_dir, str(tmp_path / "nobody-listens.sock"))
    ids = engine.tokenizer.encode(ascii_prompt(50, seed=1))
    cold, _ = run(engine, ids, COLD)
    assert run(engine, ids, NO_LOCAL) == (cold, (0, 0, 50))
    stats = engine.stats()
    assert stats.pool_unavailable >= 1 and stats.pool_connects == 0


def test_pool_restart_goes_cold_then_reconnects(tiny_dir, tmp_path):
    socket_path = str(tmp_path / "pool.sock")
    os.chmod(tmp_path, 0o700)
    proc = start_pool(socket_path, "32MiB", POOL_ARGS)
    try:
        engine = _engine(tiny_dir, socket_path)
        ids = engine.tokenizer.encode(ascii_prompt(50, seed=2))
        cold, _ = run(engine, ids, COLD)
        assert run(engine, ids, NO_LOCAL) == (cold, (0, 0, 50))
        assert run(engine, ids, NO_LOCAL) == (cold, (0, 48, 2))
        stop_process(proc)
        assert run(engine, ids, NO_LOCAL) == (cold, (0, 0, 50))  # the pool died: cold, still right
        assert engine.stats().pool_unavailable >= 1
        proc = start_pool(socket_path, "32MiB", POOL_ARGS)  # a new, empty pool at the same socket
        time.sleep(0.3)  # past the backoff
        assert run(engine, ids, NO_LOCAL) == (cold, (0, 0, 50))  # reconnected; the new pool is empty ...
        assert run(engine, ids, NO_LOCAL) == (cold, (0, 48, 2))  # ... and the request refilled it
        assert engine.stats().pool_connects == 2
    finally:
        stop_process(proc)
