"""A request that is not a stream on a batching replica (vLLM): its response shows nothing before its end, so its
request counts as prefill ahead only until it is due (kvshare.router.backlog), never for its whole decode."""

import asyncio
import threading
import time
import urllib.request

import pytest

from kvshare.router.backlog import Backlog
from kvshare.router.facts import route_facts


def test_an_unstreamed_job_counts_as_prefill_ahead_until_it_is_due_then_as_decoding():
    """Fails when a blind entry counts until its end: the replica then looks busy with its 0.3 s prefill at t=5,
    and a request sent then is marked as sharing its prefill (and never fitted)."""
    backlog = Backlog(1, is_batching=True)
    ahead = backlog.begin(0, 4.0, 0.5, now=0.0)  # a stream, its first byte not yet back
    blind = backlog.begin(0, 4.0, 0.3, now=0.1, is_blind=True)
    assert blind.due_s == pytest.approx(0.1 + 0.5 + 0.3)  # behind the stream's prefill, then its own
    assert backlog.wait_s(0, 0.5) == pytest.approx(0.8)
    backlog.started(ahead)
    assert backlog.wait_s(0, 0.8) == pytest.approx(0.3)  # still due
    assert backlog.wait_s(0, 5.0) == 0.0  # both decode now
    late = backlog.begin(0, 4.0, 0.2, now=5.0)
    assert not late.is_shared
    assert blind.is_shared  # it was sent while the stream's prefill ran


def test_a_replica_serving_one_request_at_a_time_counts_an_unstreamed_job_whole():
    """The built-in engine serves in order: a blind entry holds its replica until its end either way."""
    backlog = Backlog(1, is_batching=False)
    backlog.begin(0, 4.0, 0.3, now=0.0, is_blind=True)
    assert backlog.wait_s(0, 10.0) == 4.0


def test_the_router_reads_whether_a_request_is_a_stream():
    salt = lambda s: ""
    facts = [route_facts("pool_aware", body, None, salt, _Prompts()) for body in BODIES]
    assert [f.is_stream for f in facts] == [True, False, False, False]


BODIES = [b'{"prompt": [1, 2], "stream": true}', b'{"prompt": [1, 2], "stream": false}', b'{"prompt": [1, 2]}']
BODIES.append(b'{"prompt": [1, 2], "stream": "yes"}')  # not a stream to vLLM either: it refuses the body


class _Prompts:
    def prompt_of(self, prompt, messages):
        return None


@pytest.mark.parametrize("is_stream", [False, True])
def test_through_the_router_an_unstreamed_request_stops_counting_once_due(is_stream):
    """A request held 1.5 s by a vLLM replica, its prefill expected in 0.1 s (the prior's service time, with no
    events to place by): 0.4 s after the send, a stream whose first byte has not come is still prefill ahead, an
    unstreamed request no longer. Fails when the relay does not tell the backlog which requests are streams."""
    from aiohttp import web

    from tests.router.fake_replica import completion_request, pool_aware_router
    from tests.router.test_pool_aware_queue import COST

    arrived, release = threading.Event(), threading.Event()

    async def completions(request):
        arrived.set()
        while not release.is_set():
            await asyncio.sleep(0.01)
        if not is_stream:
            return web.json_response({"choices": [{"text": "a"}], "usage": {"prompt_tokens": 2}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
        return response

    with pool_aware_router(completions, COST, engine="vllm") as (server, router_url):
        placer = server.pool_aware
        req = completion_request(router_url, prompt=[1, 2, 3], max_tokens=2, stream=is_stream)
        client = threading.Thread(target=lambda: urllib.request.urlopen(req, timeout=60).read())
        client.start()
        assert arrived.wait(30)
        time.sleep(0.4)
        jobs, wait = placer.backlog.num_entries(0), placer.backlog.wait_s(0, time.monotonic())
        release.set()
        client.join(30)
    assert jobs == 1
    assert wait == (pytest.approx(COST.queue_s_per_request) if is_stream else 0.0)
