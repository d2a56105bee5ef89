"""pool_aware's rates behind batching replicas (vLLM): fitted only from prefills that ran alone on their replica
(kvshare.router.backlog marks the others, kvshare.router.calibration leaves them out)."""

import asyncio
import threading
import urllib.request

import numpy as np
import pytest

from kvshare.router.backlog import Backlog
from kvshare.router.calibration import Calibration, CalibrationConfig, Rates
from kvshare.router.response_timing import ResponseTiming

# the replica's true terms: 40 ms a request, 20k prompt tokens/s computed, 143k tokens/s loaded from the pool
OVERHEAD_S, PREFILL_S, LOAD_S = 0.04, 5e-5, 7e-6
# the flags' starting values: 4x off on every term, so a fit that stays at them fails the test
PRIOR = Rates(overhead_s=0.16, prefill_s_per_token=2e-4, load_s_per_token=2.8e-5, service_s=2.0, decode_s=1.5)
TOKEN = b'data: {"choices": [{"text": "a"}]}\n\n'


def test_a_prefill_sent_while_another_has_not_started_is_shared_both_ways():
    backlog = Backlog(2, is_batching=True)
    a = backlog.begin(0, 1.0, 0.5)
    other_replica = backlog.begin(1, 1.0, 0.5)
    b = backlog.begin(0, 1.0, 0.5)  # a has sent nothing yet: each waits on the other's prefill
    backlog.started(a)
    backlog.started(b)
    c = backlog.begin(0, 1.0, 0.5)  # a and b decode beside it: its prefill runs alone
    assert (a.is_shared, b.is_shared, c.is_shared, other_replica.is_shared) == (True, True, False, False)


def batching_replica_trace(rng):
    """(sent, first byte, end, computed, pool) of requests on a replica that computes prefills one after another
    (chunked prefill) and decodes beside them: 40 sent alone, and 15 bursts of 4 sent together, each of those
    loading a shared prefix from the pool (a wave of sessions over one system prompt), so a burst's wait behind
    the others' prefill rides on its pool tokens."""
    requests, t = [], 0.0
    kinds = ["alone"] * 40 + ["burst"] * 15
    rng.shuffle(kinds)
    for kind in kinds:
        for _ in range(1 if kind == "alone" else 4):
            computed = int(rng.integers(200, 1200))
            pool = int(rng.integers(4000, 6000)) if kind == "burst" or rng.random() < 0.5 else 0
            requests.append([t, computed, pool])
        t += 20.0  # every prefill of one group is done before the next is sent
    trace, busy_until = [], 0.0
    for sent, computed, pool in requests:
        first = max(sent, busy_until) + (OVERHEAD_S + computed * PREFILL_S + pool * LOAD_S) * rng.normal(1, 0.02)
        busy_until = first
        trace.append((sent, first, first + 3.0, computed, pool))  # 3 s of decode, beside later prefills
    return trace


def replay(trace, calibration: Calibration, backlog: Backlog, tell_shared: bool) -> None:
    """Each request through the router's objects in time order, as the relay drives them: the backlog's entry from
    the send, the response timed piece by piece, its provenance in its last chunk."""
    events = []
    for k, (sent, first, end, _, _) in enumerate(trace):
        events += [(sent, 0, k), (first, 1, k), (end, 2, k)]
    jobs, timings = {}, {}
    for now, kind, k in sorted(events):
        _, _, _, computed, pool = trace[k]
        if kind == 0:
            job = jobs[k] = backlog.begin(0, 1.0, 0.5)
            timing = timings[k] = ResponseTiming(calibration, 0, now, is_stream=True)
            timing.on_first_byte = lambda job=job: backlog.started(job)
            if tell_shared:
                timing.is_prefill_shared = lambda job=job: job.is_shared
        elif kind == 1:
            timings[k].piece(TOKEN, now)
        else:
            final = b'data: {"choices": [], "kvshare": {"computed_tokens": %d, "pool_tokens": %d}}\n\n'
            timings[k].piece(final % (computed, pool), now)
            timings[k].end(now)
            backlog.finish(jobs[k])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_batching_replicas_rates_are_fitted_from_the_prefills_that_ran_alone(seed):
    """Fails when every prefill is fitted: a burst's wait behind its neighbours reads as a slow pool load and a
    cheap prefill (checked below on the same trace: the fit is then off by more than 2x)."""
    trace = batching_replica_trace(np.random.default_rng(seed))
    config = CalibrationConfig(window=128)
    rates = {}
    for tell_shared in (True, False):
        calibration = Calibration(PRIOR, 1, config, is_batching=True)
        replay(trace, calibration, Backlog(1, is_batching=True), tell_shared)
        rates[tell_shared] = calibration.rates(0)
    alone = rates[True]
    assert alone.num_samples == 40  # the requests sent alone (a burst's first overlaps the others sent with it)
    assert alone.prefill_s_per_token == pytest.approx(PREFILL_S, rel=0.1)
    assert alone.load_s_per_token == pytest.approx(LOAD_S, rel=0.25)
    assert alone.overhead_s == pytest.approx(OVERHEAD_S, abs=0.02)
    every = rates[False]
    assert every.num_samples == len(trace)
    off = max(every.load_s_per_token / LOAD_S, PREFILL_S / every.prefill_s_per_token)
    assert off > 2, "the trace must tell the two fits apart"


def test_the_proxy_tells_the_calibration_which_prefills_overlapped():
    """Two streams sent together to a vLLM replica are not fitted, one sent alone is. Fails when the relay does
    not hand the entry's mark to the response's timing (three samples)."""
    from aiohttp import web

    from tests.router.fake_replica import completion_request, pool_aware_router
    from tests.router.test_pool_aware_queue import COST

    both_sent, arrived = threading.Event(), []

    async def completions(request):
        arrived.append(1)
        if len(arrived) == 2:
            both_sent.set()
        while len(arrived) < 3 and not both_sent.is_set():
            await asyncio.sleep(0.01)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(TOKEN)
        await response.write(b'data: {"choices": [], "kvshare": {"computed_tokens": 5, "pool_tokens": 0}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    def send():
        req = completion_request(router_url, prompt="hello", max_tokens=2, stream=True)
        urllib.request.urlopen(req, timeout=60).read()

    with pool_aware_router(completions, COST, engine="vllm") as (server, router_url):
        pair = [threading.Thread(target=send) for _ in range(2)]
        for client in pair:
            client.start()
        for client in pair:
            client.join(60)
        after_pair = len(server.pool_aware.calibration.replicas[0].samples)
        send()
        after_alone = len(server.pool_aware.calibration.replicas[0].samples)
    assert both_sent.is_set()
    assert (after_pair, after_alone) == (0, 1)
