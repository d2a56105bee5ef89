"""The engine worker holds the engine after a request's first token until the handler has written it.

Publishing the prompt's chunks (the engine's next step after the first token) runs Python on the worker's
thread; while it held the GIL, the handler's write of the first token waited for the interpreter's switch
interval (up to 5 ms of TTFT on the H200's timeline).
"""

import asyncio
import time

from kvshare.serve import worker as W


class RecordingEngine:
    """Yields two events; records when the generator was resumed after the first."""

    def __init__(self) -> None:
        self.resumed_s: float | None = None

    def generate(self, prompt_ids, params, options):
        yield "first"
        self.resumed_s = time.perf_counter()
        yield "second"


async def run_one(engine, set_after_s: float | None) -> tuple[float, float]:
    """(when the handler saw the first event, when it set first_written); the job runs to its end."""
    worker = W.EngineWorker(engine, max_requests=1)
    worker.start()
    job = W.WorkerRequest([1, 2, 3], None, None, asyncio.get_running_loop())
    worker.submit(job)
    seen_s = set_s = float("nan")
    async for event in job.stream():
        if event == "first":
            seen_s = time.perf_counter()
            if set_after_s is not None:
                await asyncio.sleep(set_after_s)
                set_s = time.perf_counter()
                job.first_written.set()
    worker.stop()
    return seen_s, set_s


def test_the_engine_goes_on_only_once_the_first_token_is_written():
    engine = RecordingEngine()
    seen_s, set_s = asyncio.run(run_one(engine, set_after_s=0.02))
    assert engine.resumed_s is not None and engine.resumed_s >= set_s > seen_s


def test_a_handler_that_never_writes_holds_the_engine_no_longer_than_the_wait():
    engine = RecordingEngine()
    seen_s, _ = asyncio.run(run_one(engine, set_after_s=None))
    waited = engine.resumed_s - seen_s
    assert W.FIRST_WRITE_WAIT_S * 0.5 <= waited < W.FIRST_WRITE_WAIT_S + 2.0, waited


def test_the_wait_is_only_after_the_first_event():
    class Many:
        def __init__(self):
            self.times = []

        def generate(self, prompt_ids, params, options):
            for i in range(5):
                self.times.append(time.perf_counter())
                yield i

    engine = Many()

    async def go():
        worker = W.EngineWorker(engine, max_requests=1)
        worker.start()
        job = W.WorkerRequest([1], None, None, asyncio.get_running_loop())
        worker.submit(job)
        job.first_written.set()  # written at once: no step waits
        got = [e async for e in job.stream()]
        worker.stop()
        return got

    assert asyncio.run(go()) == [0, 1, 2, 3, 4]
    assert engine.times[-1] - engine.times[0] < W.FIRST_WRITE_WAIT_S
