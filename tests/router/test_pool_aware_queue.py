"""pool_aware's queue term (kvshare.router.backlog) and its near-tie rule, decided on constructed states."""

import asyncio
import itertools
import urllib.request

import pytest

from kvshare.router.backlog import Backlog
from kvshare.router.calibration import Calibration, CalibrationConfig
from kvshare.router.config import RouterConfig
from kvshare.router.cost_model import NEAR_TIE, CostModel, rank
from kvshare.router.policy import ReplicaView, RouteFacts, Router
from kvshare.router.pool_aware import PoolAwareConfig, PoolAwarePlacer
from kvshare.router.server import RouterServer
from tests.router.test_pool_aware import FakeFeed

# 1000 prompt tokens/s, 0.1 s of decode per request until measured
COST = CostModel(kv_bytes_per_token=1000, load_bytes_per_s=1e7, prefill_tokens_per_s=1000, queue_s_per_request=0.1)


def router_with(cost=COST, num_replicas=2, is_batching=False) -> Router:
    router = Router(
        "pool_aware",
        num_replicas,
        pool_aware=PoolAwarePlacer(num_replicas, cost, FakeFeed([]), is_batching=is_batching),
    )
    return router


_FIRST_IDS = itertools.count(1000, 10_000)


def new_prompt(num_tokens: int) -> list[int]:
    """A prompt of its own (< 10k tokens): nobody holds it, not the pool, not a replica this router sent one to."""
    first = next(_FIRST_IDS)
    return list(range(first, first + num_tokens))


def place(router: Router, num_tokens: int, in_flight, now: float, first: int = 0) -> int:
    """Places a prompt nobody holds (``first``: the rotation's turn) and begins its backlog entry where it went."""
    router._next = first
    views = [ReplicaView(i, True, q) for i, q in enumerate(in_flight)]
    chosen = router.choose(RouteFacts(prompt_ids=new_prompt(num_tokens)), views, now)[0]
    router.pool_aware.backlog.begin(chosen, router.pool_aware.last_placement.work_s[chosen])
    return chosen


def test_the_backlog_sums_the_expected_work_of_the_jobs_in_flight():
    backlog = Backlog(2)
    first = backlog.begin(0, 2.0)
    backlog.begin(0, 0.5)
    backlog.begin(1, -1.0)  # a negative estimate counts as none
    assert backlog.wait_s(0) == pytest.approx(2.5)
    backlog.finish(first)
    backlog.finish(first)  # twice: nothing more
    assert backlog.num_entries(0) == 1 and backlog.wait_s(0) == pytest.approx(0.5)
    assert backlog.wait_s(1) == 0.0


def test_a_batching_replicas_wait_is_the_prefill_still_ahead_not_the_decodes():
    """A batching replica (vLLM) decodes beside a new request's prefill: only jobs that have not sent their first
    byte hold a new one back, by their time to first token. A serial replica waits for every request whole."""
    batching, serial = Backlog(1, is_batching=True), Backlog(1)
    for backlog in (batching, serial):
        first = backlog.begin(0, 5.0, 0.2)  # 0.2 s to its first token, then 4.8 s of decode
        backlog.begin(0, 5.0, 0.3)
        backlog.begin(0, 1.0)  # its split not known: all of it before its first token
        backlog.started(first)
    assert batching.wait_s(0) == pytest.approx(1.3)
    assert serial.wait_s(0) == pytest.approx(11.0)


@pytest.mark.parametrize("is_batching, expected", [(True, 0), (False, 1)], ids=["batching", "serial"])
def test_a_batching_replica_decoding_others_keeps_the_session_whose_prefix_it_holds(is_batching, expected):
    """Replica 0 was sent a session's 2000-token prefix and decodes three long answers; replica 1 is idle and
    holds nothing (nor does the pool). The session's next turn goes back to replica 0 when it batches (its decodes
    do not delay the turn's first token, and it computes 100 tokens instead of 2100) and to replica 1 when it
    serves one request at a time. Fails with the serial wait for a batching replica (the routing workload with
    vLLM replicas: pool_aware then balanced request counts and moved sessions off their replica)."""
    router = router_with(is_batching=is_batching)
    placer = router.pool_aware
    prefix = new_prompt(2000)
    router._next = 0
    views = [ReplicaView(0, True, 0), ReplicaView(1, True, 0)]
    assert router.choose(RouteFacts(prompt_ids=prefix), views, 0.0)[0] == 0
    for _ in range(3):
        placer.backlog.started(placer.backlog.begin(0, 5.0, 0.1))  # answers being decoded
    router._next = 1
    views = [ReplicaView(0, True, 3), ReplicaView(1, True, 0)]
    turn = prefix + list(range(500_000, 500_100))
    assert router.choose(RouteFacts(prompt_ids=turn), views, 1.0)[0] == expected


def test_a_replica_behind_one_long_prompt_is_busier_than_one_behind_one_short_one():
    """Both replicas have one request in flight; replica 0's is a 2000-token prompt, replica 1's a 100-token one.
    A new prompt goes to replica 1. Fails with the queue as requests in flight x the mean service time (the
    replicas tie, and the turn gives replica 0)."""
    router = router_with()
    assert place(router, 2000, [0, 0], now=0.0, first=0) == 0
    assert place(router, 100, [1, 0], now=0.0, first=1) == 1
    assert place(router, 500, [1, 1], now=0.0, first=0) == 1
    assert router.pool_aware.queue_s(0, 1, router.pool_aware.calibration.rates(0), 0.0) == pytest.approx(2.1)


def test_the_request_being_served_counts_whole_however_long_it_has_run():
    """Equal jobs (1000 tokens: 1.1 s expected); replica 0's began 1.0 s ago, replica 1's now: the replicas tie
    and the turn decides. Its decode length unknown, a request in service is not credited with its progress
    (crediting it sent new requests behind ones that then ran long). Fails when the backlog subtracts the time
    the oldest request has been served (replica 0 would look nearly free)."""
    router = router_with()
    assert place(router, 1000, [0, 0], now=0.0, first=0) == 0
    assert place(router, 1000, [1, 0], now=1.0, first=1) == 1
    assert [place(router, 10, [1, 1], now=1.0, first=first) for first in (1, 0)] == [1, 0]


def test_the_queue_term_reads_the_backlog_of_requests_just_placed():
    """Two prompts placed at the same instant, before any response, with views that say nothing is in flight:
    they spread. Fails when the queue term is the views' count x the mean service time."""
    router = router_with()
    assert [place(router, 1000, [0, 0], now=0.0, first=0) for _ in range(2)] == [0, 1]


def test_in_flight_requests_the_backlog_does_not_know_count_the_mean_service_time():
    placer = router_with().pool_aware
    rates = placer.calibration.rates(0)
    assert placer.queue_s(0, 3, rates, now=0.0) == pytest.approx(3 * rates.service_s)


def test_near_ties_are_taken_in_turn_and_a_clear_difference_is_not():
    """Fails when rank ignores ``near_tie`` (replica 0, 3% faster, would take every request)."""
    assert [rank([1.00, 1.03], [True, True], rotation, NEAR_TIE)[0] for rotation in range(4)] == [0, 1, 0, 1]
    assert [rank([1.00, 1.20], [True, True], rotation, NEAR_TIE)[0] for rotation in range(4)] == [0, 0, 0, 0]
    assert rank([1.00, 1.01], [False, True], 0, NEAR_TIE) == [1, 0]  # an unavailable replica never ties
    assert rank([0.0, 0.0, 0.0], [True, True, True], 2, NEAR_TIE) == [2, 0, 1]


def test_idle_replicas_measured_a_few_percent_apart_share_the_requests():
    """Replica 1 measured 3% slower per prompt token: sequential first turns (each done before the next) still
    alternate. Fails when the placer ranks without the near-tie rule (replica 0 takes all eight)."""
    router = router_with()
    calibration = router.pool_aware.calibration
    for i, seconds_per_token in enumerate((1.00e-3, 1.03e-3)):
        for k in range(16):
            computed, t0 = 100 + 50 * k, 100.0 * k
            calibration.observe(i, t0, t0 + computed * seconds_per_token, t0 + 1.0, computed, 0)
    chosen = []
    for k in range(8):
        router._next = k % 2
        idle = [ReplicaView(0, True, 0), ReplicaView(1, True, 0)]
        chosen.append(router.choose(RouteFacts(prompt_ids=new_prompt(1000)), idle, 0.0)[0])
    assert chosen == [0, 1] * 4


def test_decode_time_is_a_streams_end_less_its_first_byte_and_a_bodys_service_less_its_prefill():
    """Fails when the calibration keeps the flag's decode time whatever the responses show."""
    config = CalibrationConfig(min_samples=3, window=8)
    calibration = Calibration(COST.prior_rates(), 2, config)
    for k in range(4):
        t0 = 10.0 * k
        calibration.observe(0, t0, t0 + 0.3, t0 + 1.3, 300, 0)  # a stream: 1.0 s after its first token
        calibration.observe(1, t0, None, t0 + 0.8, 300, 0)  # a body: 0.8 s in all, 0.3 s of it prefill (flags)
    assert calibration.rates(0).decode_s == pytest.approx(1.0)
    assert calibration.rates(1).decode_s == pytest.approx(0.5)


def test_the_proxy_begins_a_job_where_it_sends_and_ends_it_with_the_response():
    """Fails when the relay does not feed the backlog (the queue term would fall back to the count x the mean)."""
    import threading

    from aiohttp import web

    from tests.router.fake_replica import completion_request, pool_aware_router

    release = threading.Event()

    async def completions(request):
        while not release.is_set():
            await asyncio.sleep(0.01)
        return web.json_response({"choices": []})

    with pool_aware_router(completions, COST) as (server, router_url):
        backlog = server.pool_aware.backlog
        req = completion_request(router_url, prompt="hello", max_tokens=2)
        client = threading.Thread(target=lambda: urllib.request.urlopen(req, timeout=60).read())
        client.start()
        try:
            for _ in range(500):
                if backlog.num_entries(0) == 1:
                    break
                release.wait(0.01)
            in_flight = backlog.num_entries(0)
        finally:
            release.set()
            client.join(60)
        for _ in range(500):
            if backlog.num_entries(0) == 0:
                break
            release.wait(0.01)
    assert in_flight == 1
    assert backlog.num_entries(0) == 0 and backlog.wait_s(0) == 0.0


def test_the_queue_decode_and_credited_depth_are_exported_per_replica():
    """Fails when the router leaves out the gauges of the queue term, the decode time or the credited depth."""
    from prometheus_client import generate_latest

    from tests.test_metrics_names import lint

    config = RouterConfig(
        replicas=("http://127.0.0.1:1",),
        policy="pool_aware",
        pool_aware=PoolAwareConfig(endpoint="tcp://127.0.0.1:1", model="tiny", cost=COST),
    )
    server = RouterServer(config)
    server.pool_aware.backlog.begin(0, 1e6)  # an entry that will not have finished when read
    text = generate_latest(server.metrics.registry).decode()
    assert lint(text) == []
    replica = '{replica="http://127.0.0.1:1"}'
    assert f"kvshare_router_pool_aware_decode_seconds{replica} 0.1" in text
    assert f"kvshare_router_pool_aware_local_cache_depth_chunks{replica} 1.0" in text
    [queue] = [
        line for line in text.splitlines() if line.startswith(f"kvshare_router_pool_aware_queue_seconds{replica}")
    ]
    assert float(queue.split()[-1]) > 1e5


def test_the_proxy_marks_a_job_started_at_its_first_byte_for_a_batching_replica():
    """A vLLM replica's request stops holding back new requests once its first byte is relayed, while it still
    streams. Fails when the relay does not tell the backlog (the wait stays the request's whole expected time)."""
    import threading

    from aiohttp import web

    from tests.router.fake_replica import completion_request, pool_aware_router

    first_sent, release = threading.Event(), threading.Event()

    async def completions(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        first_sent.set()
        while not release.is_set():
            await asyncio.sleep(0.01)
        await response.write(b"data: [DONE]\n\n")
        return response

    with pool_aware_router(completions, COST, engine="vllm") as (server, router_url):
        backlog = server.pool_aware.backlog
        assert backlog.is_batching
        req = completion_request(router_url, prompt="hello", max_tokens=2, stream=True)
        client = threading.Thread(target=lambda: urllib.request.urlopen(req, timeout=60).read())
        client.start()
        try:
            assert first_sent.wait(30)
            for _ in range(500):
                if backlog.num_entries(0) == 1 and backlog.wait_s(0) == 0.0:
                    break
                release.wait(0.01)
            streaming, wait = backlog.num_entries(0), backlog.wait_s(0)
        finally:
            release.set()
            client.join(60)
    assert streaming == 1 and wait == 0.0
