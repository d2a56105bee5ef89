"""A replica that stops, or a client that leaves, frees the engine during a prefill, not only between tokens.

A 46 s prefill (the 32B shape at 128k on the H200) used to outlast the worker's 30 s join at shutdown: the
process then ended with the engine thread still in the forward ("terminate called without an active
exception"). The worker now hands the engine a cancel check that the prefill asks before every layer.
"""

import asyncio
import logging
import threading
import time

import pytest

from kvshare.engine.engine import RequestOptions
from kvshare.errors import RequestCancelled
from kvshare.serve import worker as W


class LongPrefill:
    """A prefill of many layers: asks the request's cancel check before each, as the engine does."""

    def __init__(self, num_layers: int = 6000, layer_s: float = 0.01) -> None:
        self.num_layers, self.layer_s = num_layers, layer_s
        self.started = threading.Event()
        self.layers_done = 0

    def generate(self, prompt_ids, params, options):
        self.started.set()
        for layer in range(self.num_layers):  # 60 s in all: longer than the worker's 30 s join
            if options.is_cancelled is not None and options.is_cancelled():
                raise RequestCancelled(f"the request was cancelled before layer {layer} of its prefill")
            time.sleep(self.layer_s)
            self.layers_done += 1
        yield "first"


async def submit(worker, engine_options=RequestOptions()):
    job = W.WorkerRequest([1, 2, 3], None, engine_options, asyncio.get_running_loop())
    worker.submit(job)
    return job


async def outcome(job) -> object:
    try:
        return [e async for e in job.stream()]
    except RequestCancelled as exc:
        return exc


def test_stop_during_a_prefill_ends_it_at_the_next_layer():
    engine = LongPrefill()

    async def go():
        worker = W.EngineWorker(engine, max_requests=4)
        worker.start()
        running = await submit(worker)
        queued = await submit(worker)
        assert await asyncio.to_thread(engine.started.wait, 30)
        await asyncio.to_thread(worker.stop)
        return worker, await outcome(running), await outcome(queued)

    worker, running, queued = asyncio.run(go())
    assert not worker._thread.is_alive()  # joined, not left running in the forward
    assert isinstance(running, RequestCancelled) and "before layer" in str(running)
    assert engine.layers_done < engine.num_layers // 2  # it did not run on to the end of the prefill
    assert queued == []  # a job still queued when the worker stops never reaches the engine


def test_a_job_whose_client_left_stops_its_prefill_and_the_next_job_runs():
    engine = LongPrefill(num_layers=6000)

    async def go():
        worker = W.EngineWorker(engine, max_requests=4)
        worker.start()
        first = await submit(worker)
        assert await asyncio.to_thread(engine.started.wait, 30)
        first.is_cancelled = True  # what the handler does when its client goes away
        result = await outcome(first)
        engine.num_layers = 3  # the next request is short
        second = await submit(worker)
        got = await outcome(second)
        worker.stop()
        return result, got

    result, got = asyncio.run(go())
    assert isinstance(result, RequestCancelled)
    assert got == ["first"]


def test_options_of_a_job_are_not_changed_for_the_caller():
    """The worker gives the engine a copy of the job's options with the check; the job's own stay as they were."""
    seen = []

    class Capture:
        def generate(self, prompt_ids, params, options):
            seen.append(options)
            yield "first"

    async def go():
        worker = W.EngineWorker(Capture(), max_requests=1)
        worker.start()
        options = RequestOptions(use_pool=False)
        job = await submit(worker, options)
        job.first_written.set()
        await outcome(job)
        worker.stop()
        return job

    job = asyncio.run(go())
    assert job.options.is_cancelled is None and seen[0].is_cancelled is not None and seen[0].use_pool is False


@pytest.mark.parametrize("flag", ["client", "stopping"])
def test_the_check_says_cancelled_for_a_client_that_left_or_a_stopping_worker(flag):
    seen = []

    class Capture:
        def generate(self, prompt_ids, params, options):
            seen.append(options.is_cancelled)
            yield "first"

    async def go():
        worker = W.EngineWorker(Capture(), max_requests=1)
        worker.start()
        job = await submit(worker)
        job.first_written.set()
        await outcome(job)
        before = seen[0]()
        if flag == "client":
            job.is_cancelled = True
            after = seen[0]()
            worker.stop()
        else:
            worker.stop()
            after = seen[0]()
        return before, after

    assert asyncio.run(go()) == (False, True)


def test_a_cancelled_request_is_answered_503_and_an_engine_failure_500():
    from kvshare.serve.http_errors import engine_error

    stopping = engine_error(RequestCancelled("the request was cancelled before layer 3 of its prefill"))
    assert (stopping.status, stopping.body()["error"]["type"]) == (503, "server_error")
    assert "before layer 3" in stopping.body()["error"]["message"]
    failed = engine_error(RuntimeError("CUDA error"))
    assert failed.status == 500 and failed.body()["error"]["message"] == "the engine failed: CUDA error"


class SlowPrefill:
    """The tiny engine, whose prefill first spends up to 60 s in layers that ask the cancel check."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.started, self.cancelled = threading.Event(), threading.Event()
        self.slow = True

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompt_ids, params, options):
        if self.slow:
            self.started.set()
            for layer in range(6000):
                if options.is_cancelled():
                    self.cancelled.set()
                    raise RequestCancelled(f"the request was cancelled before layer {layer} of its prefill")
                time.sleep(0.01)
        yield from self._engine.generate(prompt_ids, params, options)


def leave_during_the_prefill(url: str, engine: SlowPrefill, stream: bool = True) -> None:
    """A request whose client closes its connection once the prefill runs."""
    import http.client
    import json

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"prompt": "once upon a time", "max_tokens": 4, "stream": stream}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    assert engine.started.wait(30)
    conn.sock.close()  # the client gives up while the prefill runs
    conn.close()


@pytest.fixture(scope="module")
def slow_engine():
    from tests.serve.live import tiny_engine

    return SlowPrefill(tiny_engine())


def test_a_client_that_disconnects_during_the_prefill_frees_the_engine(slow_engine):
    """Through a real replica: the client closes its connection while the prefill runs; the engine is told at
    its next layer (not after the whole prefill), and the next request is served."""
    from tests.serve.live import call, metric, replica

    engine = slow_engine
    engine.started.clear(), engine.cancelled.clear()
    engine.slow = True
    with replica(engine) as url:
        leave_during_the_prefill(url, engine)
        assert engine.cancelled.wait(30), "the engine ran on after its client left"
        for _ in range(100):  # the handler counts it once the worker hands it the lost connection
            if metric(url, "kvshare_request_cancelled_total") == 1:
                break
            time.sleep(0.1)
        assert metric(url, "kvshare_request_cancelled_total") == 1
        engine.slow = False
        status, out = call(url, "/v1/completions", {"prompt": "once upon a time", "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        for _ in range(50):  # the response leaves at its last token; the worker counts the job done just after
            if metric(url, "kvshare_num_requests_running") == 0:
                break
            time.sleep(0.1)
        assert metric(url, "kvshare_num_requests_running") == 0


def test_a_non_streamed_request_whose_client_left_still_ends_with_a_response(slow_engine, caplog):
    """The handler of a non-streamed request whose client left answers with a response object (499, never
    sent) instead of None, which aiohttp logs as an error with a traceback ("Missing return statement")."""
    from tests.serve.live import metric, replica

    engine = slow_engine
    engine.started.clear(), engine.cancelled.clear()
    engine.slow = True
    with caplog.at_level(logging.ERROR, logger="aiohttp"), replica(engine) as url:
        leave_during_the_prefill(url, engine, stream=False)
        assert engine.cancelled.wait(30), "the engine ran on after its client left"
        for _ in range(100):
            if metric(url, "kvshare_request_cancelled_total") == 1:
                break
            time.sleep(0.1)
        assert metric(url, "kvshare_request_cancelled_total") == 1
    engine.slow = False
    assert [r.getMessage() for r in caplog.records if r.name.startswith("aiohttp")] == []


def test_through_the_router_too_and_the_replica_stays_healthy(slow_engine):
    """The router waits on the replica while it computes; a client that leaves then makes the router close
    its connection to the replica, which gives the request up, and the router does not blame the replica."""
    from kvshare.router.config import RouterConfig
    from kvshare.router.server import RouterServer
    from tests.serve.live import LiveApp, call, replica

    engine = slow_engine
    engine.started.clear(), engine.cancelled.clear()
    engine.slow = True
    with replica(engine) as url:
        router = RouterServer(RouterConfig(replicas=(url,), policy="round_robin"))
        with LiveApp(router.app()) as r:
            leave_during_the_prefill(r, engine)
            assert engine.cancelled.wait(30), "the replica ran on after the router's client left"
            assert all(state.is_healthy for state in router.replicas)
            engine.slow = False
            status, out = call(r, "/v1/completions", {"prompt": "once upon a time", "max_tokens": 2})
            assert status == 200 and out["usage"]["completion_tokens"] == 2
