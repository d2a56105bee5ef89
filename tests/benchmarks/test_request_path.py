"""benchmarks/request_path.py: the files a request runs code in follow what it does (a pool hit crosses the
transfer modules, a cold request does not), and the window ends at the first token, before the prompt's store."""

from __future__ import annotations

import pytest

from tests.benchmarks.loader import load_benchmark


@pytest.fixture(scope="module")
def result():
    return load_benchmark("request_path").measure(512, is_first=False)


def test_a_pool_hit_crosses_the_transfer_and_a_cold_request_does_not(result):
    """Fails when the recorder misses the load's modules or counts a cold request's store as before its token."""
    cold, pool = result["cold"]["files"], result["pool"]["files"]
    assert result["pool_tokens"] > 0
    assert "transfer/cpu.py" in pool and "transfer/cpu.py" not in cold
    assert {"serve/server.py", "serve/worker.py", "engine/engine.py", "engine/model.py"} <= set(cold) & set(pool)
    assert "engine/publish.py" not in cold  # the store runs after the first token
    assert all("loop" in t or t == "engine-worker" for threads in cold.values() for t in threads)
