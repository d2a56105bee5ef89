"""benchmarks/vllm_load_path.py: the window is the request's, from the connector's first call for it (the
scheduler takes it in) to the scheduler taking in its first token, over the records of every process of the
server; and, with vLLM, a load crosses the connector's CPU worker and a cold request's window does not load."""

from __future__ import annotations

import os

import pytest

from tests.benchmarks.loader import load_benchmark

VLLM_PYTHON = os.environ.get("KVSHARE_VLLM_PYTHON", "/work/.venv-vllm/bin/python")


@pytest.fixture(scope="module")
def path():
    return load_benchmark("vllm_load_path")


def test_the_window_opens_at_scheduling_and_closes_at_the_first_token(path):
    """Fails when a record before the request, after its first token, or of an earlier request is counted."""
    opens = "KVShareConnector.on_new_request"
    records = [
        [1.0, "integrations/vllm/connector.py", opens, "MainThread", "EngineCore"],  # an earlier request
        [1.5, path.FIRST_TOKEN, "update_from_output", "MainThread", "EngineCore"],
        [2.0, "pool/link.py", "PoolLink.watch", "pool-watch", "EngineCore"],  # sent at 2.0, before scheduling
        [3.0, "integrations/vllm/connector.py", opens, "MainThread", "EngineCore"],
        [3.5, "integrations/vllm/cpu.py", "CpuKVWorker.start_loads", "MainThread", "VLLM::Worker"],
        [4.0, path.FIRST_TOKEN, "update_from_output", "MainThread", "EngineCore"],
        [4.5, "integrations/vllm/scheduler.py", "PoolScheduler.finish", "MainThread", "EngineCore"],
    ]
    result = path.window(records, sent_at=2.0)
    assert result["files"] == {
        "integrations/vllm/connector.py": ["EngineCore/MainThread"],
        "integrations/vllm/cpu.py": ["VLLM::Worker/MainThread"],
    }
    assert result["window_s"] == 1.0
    assert result["before_window"] == {"pool/link.py": ["EngineCore/pool-watch: PoolLink.watch"]}


def test_a_request_the_connector_never_saw_is_refused(path):
    with pytest.raises(RuntimeError, match="not asked"):
        path.window([[1.0, path.FIRST_TOKEN, "update_from_output", "MainThread", "EngineCore"]], sent_at=0.0)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason="needs the vLLM venv (KVSHARE_VLLM_PYTHON)")
def test_a_load_crosses_the_cpu_worker_and_a_cold_request_does_not_load(path):
    """Fails when the hook misses the worker's process (the load's copies and checks) or the window misses the
    load, or counts a load in the cold request's window."""
    result = path.measure(VLLM_PYTHON, 1024, is_first=False)
    cold, load = result["cold"]["functions"], result["load"]["functions"]
    assert result["cached_tokens_b"] > 0
    assert "CpuKVWorker.start_loads" in load["integrations/vllm/cpu.py"]
    assert "is_valid" in load["pool/checksum.py"]  # the loaded pages are checked before the copy
    assert "CpuKVWorker.start_loads" not in cold["integrations/vllm/cpu.py"]
    assert "CpuKVWorker.start_stores" in cold["integrations/vllm/cpu.py"]  # A stores before its first token
    assert {"integrations/vllm/connector.py", "integrations/vllm/scheduler.py"} <= set(load)
