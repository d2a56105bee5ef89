"""The built-in engine serves one request at a time; /metrics says so.

A gate holds the engine's first request, so the state asserted (one running, the rest queued) is not a race.
"""

import concurrent.futures
import threading
import time

import pytest

from tests.serve.live import call, metric, replica, tiny_engine


class GatedEngine:
    """The real engine, whose requests start only once ``gate`` is open."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompt_ids, params, options):
        assert self.gate.wait(60), "the test never opened the gate"
        yield from self._engine.generate(prompt_ids, params, options)


def wait_for(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def engine():
    return GatedEngine(tiny_engine())


def test_one_request_runs_the_rest_wait_and_metrics_show_the_queue(engine):
    body = {"prompt": "once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with replica(engine) as url, concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert metric(url, "kvshare_max_num_running_requests") == 1
        futures = [pool.submit(call, url, "/v1/completions", body) for _ in range(3)]
        wait_for(lambda: metric(url, "kvshare_num_requests_waiting") == 2, "two queued requests")
        assert metric(url, "kvshare_num_requests_running") == 1
        assert call(url, "/health")[1]["waiting"] == 2
        time.sleep(0.2)  # queue time the waiting requests accrue while the first is held
        engine.gate.set()
        results = [f.result(120) for f in futures]
        assert all(status == 200 for status, _ in results), results
        assert metric(url, "kvshare_num_requests_waiting") == 0 and metric(url, "kvshare_num_requests_running") == 0
        assert metric(url, "kvshare_request_queue_time_seconds_count") == 3
        assert metric(url, "kvshare_request_queue_time_seconds_sum") >= 0.4  # two requests waited >= 0.2 s each
