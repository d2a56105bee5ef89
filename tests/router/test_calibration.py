"""pool_aware's cost terms measured from relayed responses (kvshare.router.calibration)."""

import asyncio
import json
import time
import urllib.request
from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvshare.router.calibration import Calibration, CalibrationConfig, Rates, ReplicaRates
from kvshare.router.chunk_chain import chain, chain_seed, chunk_hash
from kvshare.router.config import RouterConfig
from kvshare.router.cost_model import CostModel
from kvshare.router.policy import ReplicaView, RouteFacts, Router
from kvshare.router.pool_aware import PoolAwareConfig, PoolAwarePlacer
from kvshare.router.response_timing import provenance_of
from kvshare.router.server import RouterServer
from tests.router.test_pool_aware import FakeFeed
from tests.test_metrics_names import lint

# the flags' guesses: prefill 2000 tokens/s, a pool load of 8192-byte tokens at 0.05 GB/s (164 us/token), 0.5 s queue
FLAGS = CostModel(kv_bytes_per_token=8192, load_bytes_per_s=0.05e9, prefill_tokens_per_s=2000, queue_s_per_request=0.5)


def synthetic_replica(rng, n, overhead_s=0.04, prefill_s=2e-3, load_s=5e-5):
    """n requests on a replica whose prefill costs ``prefill_s`` per computed token and ``load_s`` per pool token,
    with 3% noise and one pause in ten (a sample far off)."""
    computed = rng.integers(20, 600, n)
    pool = rng.integers(0, 4000, n) * rng.integers(0, 2, n)  # half the requests load nothing
    seconds = (overhead_s + computed * prefill_s + pool * load_s) * rng.normal(1.0, 0.03, n)
    seconds[::10] += 3.0
    return computed, pool, seconds


def test_the_estimator_converges_to_a_synthetic_replicas_rates_from_the_flags():
    fit = ReplicaRates(FLAGS.prior_rates())
    rng = np.random.default_rng(7)
    for c, p, s in zip(*synthetic_replica(rng, 200)):
        fit.add_prefill(int(c), int(p), float(s))
    rates = fit.rates
    assert rates.prefill_s_per_token == pytest.approx(2e-3, rel=0.1)  # the flags said 5e-4
    assert rates.load_s_per_token == pytest.approx(5e-5, rel=0.2)  # the flags said 1.6e-4
    assert rates.overhead_s == pytest.approx(0.04, abs=0.03)
    assert rates.num_samples == CalibrationConfig().window


def test_until_enough_samples_and_for_a_term_never_seen_the_flags_hold():
    prior = FLAGS.prior_rates()
    fit = ReplicaRates(prior)
    for _ in range(CalibrationConfig().min_samples - 1):
        fit.add_prefill(100, 0, 0.3)
    assert fit.rates == replace(prior, num_measured=CalibrationConfig().min_samples - 1)
    for computed in range(100, 2000, 100):  # nothing loaded from the pool: its term stays the flag's
        fit.add_prefill(computed, 0, computed * 3e-3)
    assert fit.rates.prefill_s_per_token == pytest.approx(3e-3, rel=0.05)
    assert fit.rates.load_s_per_token == pytest.approx(prior.load_s_per_token)


def test_the_queue_term_is_the_replicas_measured_service_time():
    """A FIFO replica taking 2 s a request: the second of two sent together waits for the first; its prefill is
    timed from the first's end, and each holds the replica 2 s."""
    calibration = Calibration(FLAGS.prior_rates(), 1, CalibrationConfig(min_samples=3, window=8))
    for k in range(4):
        t0 = 10.0 * k
        calibration.observe(0, t0, t0 + 0.5, t0 + 2.0, 100, 0)
        calibration.observe(0, t0, t0 + 2.5, t0 + 4.0, 100, 0)  # queued behind the first until t0 + 2
    rates = calibration.rates(0)
    assert rates.service_s == pytest.approx(2.0)
    assert rates.overhead_s + 100 * rates.prefill_s_per_token == pytest.approx(0.5, rel=0.05)


def test_a_stream_tail_and_a_body_give_the_provenance_and_a_withheld_one_none():
    final = (
        b'data: {"choices":[{"text":"x"}],"kvshare":{"replica":"a","local_tokens":3,"pool_tokens":512,'
        b'"computed_tokens":40,"timeline":{"arrival":0.0}}}\n\ndata: [DONE]\n\n'
    )
    assert provenance_of(b'"ignored half an event"}\n\n' + final) == (40, 512)
    assert provenance_of(b'{"choices":[],"kvshare":{"pool_tokens":0,"computed_tokens":9}}') == (9, 0)
    assert provenance_of(b'{"kv_transfer_params":{"kvshare":{"pool_tokens":256,"computed_tokens":1}}}') == (1, 256)
    assert provenance_of(b'data: {"choices":[],"kvshare":{}}\n\ndata: [DONE]\n\n') is None


def quarter_held_on_replica_0(prompt) -> Router:
    router = Router("pool_aware", 2, pool_aware=PoolAwarePlacer(2, FLAGS, FakeFeed([])))
    router.pool_aware.sent.remember(0, chain(prompt[:256], 256, None))
    return router


def test_t_r_places_by_the_measured_rates_where_the_flags_would_place_elsewhere():
    """Replica 0 holds a quarter of the prompt on its GPU. By the flags (both replicas at 2000 tokens/s) replica 0,
    computing 768 tokens, beats replica 1 computing 1024; measured, replica 0 computes at 500 tokens/s and replica 1
    at 2000, so replica 1 wins. Fails when the placer ranks by the flags (``expected_ttft`` without
    ``self.calibration.rates(i)``)."""
    prompt = list(range(4000, 4000 + 1024))
    facts = RouteFacts(prompt_ids=prompt)
    idle = [ReplicaView(0, True, 0), ReplicaView(1, True, 0)]
    assert quarter_held_on_replica_0(prompt).choose(facts, idle, now=0.0)[0] == 0
    router = quarter_held_on_replica_0(prompt)
    for i, seconds_per_token in enumerate((2e-3, 5e-4)):  # what each replica's responses showed
        for k in range(16):
            computed, t0 = 50 + 20 * k, 100.0 * k
            router.pool_aware.calibration.observe(i, t0, t0 + computed * seconds_per_token, t0 + 1.0, computed, 0)
    assert router.choose(facts, idle, now=0.0)[0] == 1


def test_a_pool_aware_routers_measured_terms_pass_promtools_rules():
    """Fails when the measured terms are not exported (no kvshare_router_pool_aware_*_per_token series)."""
    config = RouterConfig(
        replicas=("http://127.0.0.1:1",),
        policy="pool_aware",
        pool_aware=PoolAwareConfig(endpoint="tcp://127.0.0.1:1", model="tiny", cost=FLAGS),
    )
    text = generate_latest(RouterServer(config).metrics.registry).decode()
    assert lint(text) == []
    assert 'kvshare_router_pool_aware_prefill_seconds_per_token{replica="http://127.0.0.1:1"} 0.0005' in text
    assert 'kvshare_router_pool_aware_service_seconds{replica="http://127.0.0.1:1"} 0.5' in text


def test_rates_are_never_zero_on_collinear_data():
    fit = ReplicaRates(Rates(0.0, 1e-3, 1e-4, 0.5))
    for _ in range(20):  # every sample the same: nothing separates the terms
        fit.add_prefill(100, 100, 0.0)
    assert fit.rates.prefill_s_per_token > 0 and fit.rates.load_s_per_token > 0


def test_the_router_times_a_relayed_stream_and_reads_its_provenance():
    """Fails when the relay does not feed what it relays to the calibration (no ResponseTiming in the relay)."""
    from aiohttp import web

    from tests.router.fake_replica import completion_request, pool_aware_router

    async def completions(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.05)  # the prefill: the first token comes after it
        await response.write(b'data: {"choices":[{"text":"a"}]}\n\n')
        final = {"choices": [{"text": ""}], "kvshare": {"local_tokens": 0, "pool_tokens": 512, "computed_tokens": 40}}
        await response.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    with pool_aware_router(completions, FLAGS) as (server, router_url):
        req = completion_request(router_url, prompt="hello", max_tokens=2, stream=True)
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert b"[DONE]" in resp.read()
        for _ in range(100):  # the relay records the end after the last write
            if server.pool_aware.calibration.replicas[0].samples:
                break
            time.sleep(0.02)
    [(computed, pool, prefill_s)] = server.pool_aware.calibration.replicas[0].samples
    assert (computed, pool) == (40, 512) and prefill_s >= 0.04


def test_the_chain_of_a_prompt_is_its_chunk_hashes_in_turn():
    """The one conversion of the whole prompt hashes what the index hashes chunk by chunk from the events."""
    ids = list(range(70_000, 70_000 + 600))
    parent, expected = chain_seed("s"), []
    for start in (0, 256):
        parent = chunk_hash(parent, ids[start : start + 256])
        expected.append(parent)
    assert chain(ids, 256, "s") == expected


def test_token_ids_that_no_4_byte_id_holds_are_placed_without_a_prefix():
    """Fails when such a prompt's ids are passed on (hashing them raised OverflowError inside the router)."""
    placer = PoolAwarePlacer(2, FLAGS, FakeFeed([]))
    assert placer.prompt_ids([1, 2, 1 << 32], None) is None and placer.prompt_ids([-1, 2], None) is None
    assert placer.prompt_ids([0, 2, (1 << 32) - 1], None) == [0, 2, (1 << 32) - 1]


def test_a_chat_template_is_compiled_once():
    """Fails when every render compiles the template again (13-28 ms of the router's placement per request)."""
    from kvshare.engine.tokenizer import CHAT_TEMPLATE, _compiled_chat_template, render_chat

    messages = [{"role": "user", "content": "hi"}]
    first = render_chat(CHAT_TEMPLATE, messages)
    misses = _compiled_chat_template.cache_info().misses
    assert render_chat(CHAT_TEMPLATE, messages) == first == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert _compiled_chat_template.cache_info().misses == misses


def test_starting_a_placer_compiles_its_chat_template_before_the_first_request():
    """Fails when start() leaves the one-time costs to the first request (no warm_up)."""
    from kvshare.engine.loader import load_tokenizer
    from kvshare.engine.tokenizer import _compiled_chat_template

    _compiled_chat_template.cache_clear()
    placer = PoolAwarePlacer(2, FLAGS, FakeFeed([]), load_tokenizer("tiny"))
    placer.feed.start = lambda: None  # no subscription here
    placer.start()
    misses = _compiled_chat_template.cache_info().misses
    assert misses == 1
    assert len(placer.prompt_ids(None, [{"role": "user", "content": "a question"}])) > 0
    assert _compiled_chat_template.cache_info().misses == misses


def test_a_text_prompts_ids_come_as_one_array_and_hash_as_the_list_would():
    """The placer reads a text (or a chat) into the tokenizer's int64 array, with no list between; its chain is
    the chain of the same ids as a list, and an array id outside 4 unsigned bytes is refused as a list's is
    (fails when le_u32 converts an array without its range check: -1 would hash as 2**32-1)."""
    from kvshare.engine.loader import load_tokenizer
    from kvshare.router.chunk_chain import le_u32

    tokenizer = load_tokenizer("tiny")
    placer = PoolAwarePlacer(2, FLAGS, FakeFeed([]), tokenizer)
    text = "a question about the weather " * 40
    ids = placer.prompt_ids(text, None)
    assert isinstance(ids, np.ndarray) and ids.tolist() == tokenizer.encode(text)
    chat = [{"role": "user", "content": text}]
    chat_ids = placer.prompt_ids(None, chat)
    assert chat_ids.tolist() == list(tokenizer.apply_chat_template(chat))
    assert chain(ids, 16, None) == chain(ids.tolist(), 16, None) and len(chain(ids, 16, None)) == len(ids) // 16
    assert chain(ids, 16, "t") == chain(ids.tolist(), 16, "t")
    for bad in ([1, -1], [1, 1 << 32]):
        with pytest.raises(OverflowError):
            le_u32(bad)
        with pytest.raises(OverflowError):
            le_u32(np.array(bad, dtype=np.int64))
