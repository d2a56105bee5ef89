"""pool_aware measures vLLM replicas by the usage their streams end with (kvshare.router.vllm_usage and
kvshare.router.calibration.split_cached), and the client gets the stream vLLM would have sent it.

vllm_streams.json holds streams recorded from vLLM 0.32 (CPU, ``--enable-prompt-tokens-details``, the tiny
preset): the same completion and chat request, each without and with ``stream_options.include_usage``, under one
``X-Request-Id`` and within one second (so the two differ only where asking for usage changes them)."""

import json
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvshare.router.calibration import Calibration
from kvshare.router.config import RouterConfig
from kvshare.router.cost_model import CostModel
from kvshare.router.placement import Placement, split_cached
from kvshare.router.policy import RouteFacts
from kvshare.router.pool_aware import PoolAwareConfig
from kvshare.router.response_timing import ResponseTiming, usage_of
from kvshare.router.server import RouterServer
from kvshare.router.vllm_usage import UsageStrip, ask_for_usage
from tests.router.fake_replica import replica_app
from tests.serve.live import LiveApp

STREAMS = {k: v.encode() for k, v in json.loads((Path(__file__).parent / "vllm_streams.json").read_text()).items()}
FLAGS = CostModel(kv_bytes_per_token=8192, load_bytes_per_s=0.05e9, prefill_tokens_per_s=2000, queue_s_per_request=0.5)


def usage_stream(prompt_tokens: int, cached_tokens: int) -> bytes:
    """The recorded completion stream with usage, its usage saying these counts."""
    recorded = STREAMS["completion_with_usage"]
    assert b'"prompt_tokens":135,' in recorded and b'"cached_tokens":128}' in recorded
    return recorded.replace(b'"prompt_tokens":135,', b'"prompt_tokens":%d,' % prompt_tokens).replace(
        b'"cached_tokens":128}', b'"cached_tokens":%d}' % cached_tokens
    )


def test_the_recorded_usage_chunk_gives_the_prompt_and_cached_tokens():
    assert usage_of(STREAMS["completion_with_usage"]) == (135, 128)
    assert usage_of(STREAMS["chat_with_usage"]) == (25, 0)
    assert usage_of(STREAMS["completion"]) is None


def test_a_vllm_stream_gets_a_replicas_terms_measured():
    """vLLM-shaped responses (the recorded final usage chunk, no ``kvshare`` object) on a replica that computes
    at 2 ms a token and loads at 0.5 ms a token (1% noise): the terms move from the flags' (0.5 ms, 0.16 ms) to
    those. Fails on the code that read only a ``kvshare`` provenance object: every sample lacked its token counts
    and the terms stayed at the flags' values (0 samples)."""
    calibration = Calibration(FLAGS.prior_rates(), 2)
    noise = np.random.default_rng(3).normal(1.0, 0.01, 16)
    for k in range(16):
        prompt_tokens = 200 + 40 * k
        # the replica was never sent this prompt (no depths): what it did not compute came from the pool
        cached = 0 if k % 2 else 32 * (2 + 7 * k % 13)
        placement = Placement([1.0, 1.0], [[], []], 32, prompt_tokens, pool_tokens=prompt_tokens // 32 * 32)
        split = lambda p, c, placement=placement: split_cached(placement, 0, p, c)
        timing = ResponseTiming(calibration, 0, 100.0 * k, True, None, split)
        first, rest = usage_stream(prompt_tokens, cached).split(b"\n\n", 1)
        prefill_s = (0.01 + (prompt_tokens - cached) * 2e-3 + cached * 5e-4) * noise[k]
        timing.piece(first + b"\n\n", 100.0 * k + prefill_s)
        timing.piece(rest, 100.0 * k + prefill_s + 0.2)
        timing.end(100.0 * k + prefill_s + 0.2)
    rates = calibration.rates(0)
    assert rates.num_samples == rates.num_measured == 16
    assert rates.prefill_s_per_token == pytest.approx(2e-3, rel=0.05)
    assert rates.load_s_per_token == pytest.approx(5e-4, rel=0.1)
    assert calibration.rates(1).num_samples == 0


def test_cached_tokens_split_only_where_the_routers_record_tells_them_apart():
    """Fails when a sample whose cached tokens could be the replica's own or the pool's is fitted either way."""
    sent_twice = Placement([0.0], [[3, 5]], 64, 1000, pool_tokens=512)  # it was sent the prompt's first 2 chunks
    never_sent = Placement([0.0], [[]], 64, 1000, pool_tokens=512)
    events_down = Placement([0.0], [[3, 5]], 64, 1000, pool_tokens=None)
    assert split_cached(sent_twice, 0, 1000, 0) == (1000, 0)  # nothing cached
    assert split_cached(sent_twice, 0, 999, 0) is None  # another prompt than the router counted
    assert split_cached(never_sent, 0, 1000, 512) == (488, 512)  # the pool's
    assert split_cached(never_sent, 0, 1000, 576) is None  # more than the pool held: not its load alone
    assert split_cached(Placement([0.0], [[]], 64, 1000, pool_tokens=None), 0, 1000, 512) is None
    assert split_cached(never_sent, 0, 1000, 48) is None  # under a chunk: its own head, yet the pool held more
    assert split_cached(Placement([0.0], [[]], 64, 1000, pool_tokens=0), 0, 1000, 48) == (952, 0)  # its own head
    assert split_cached(sent_twice, 0, 1000, 512) is None  # its own, the pool's, or both: not told
    assert split_cached(sent_twice, 0, 1000, 160) is None  # within what the pool held
    assert split_cached(Placement([0.0], [[3, 5]], 64, 1000, pool_tokens=64), 0, 1000, 160) == (840, 0)
    assert split_cached(events_down, 0, 1000, 160) is None  # what the pool held is not known
    assert split_cached(sent_twice, 0, 1000, 1001) is None


def test_a_replicas_own_events_split_its_cached_tokens_where_the_routers_memory_cannot():
    """The replica was sent the prompt before (its memory cannot tell) but its events said what its GPU held.
    Fails when the split ignores the replica's own events (None for each of these)."""
    own = [640, None]  # replica 0's GPU held 640 tokens of the prompt by its events; replica 1's not known
    placement = Placement([0.0, 0.0], [[3, 5], [3, 5]], 64, 1000, pool_tokens=768, own_tokens=own)
    assert split_cached(placement, 0, 1000, 640) == (360, 0)  # its own
    assert split_cached(placement, 0, 1000, 512) == (488, 0)  # its own (it lost some since)
    assert split_cached(placement, 0, 1000, 768) == (232, 128)  # its own, then the pool's
    assert split_cached(placement, 0, 1000, 832) is None  # more than either held: an event not seen yet
    assert split_cached(placement, 1, 1000, 768) is None  # replica 1: by the router's memory, not told


def test_a_replicas_plain_blocks_are_indexed_as_vllm_publishes_them():
    """vLLM 0.26 and 0.32 publish ``extra_keys`` with one entry a block, None for a block keyed by its tokens
    alone. Fails when any extra_keys list counts as keyed (a replica's GPU index then stays empty)."""
    from kvshare.pool import events as E
    from kvshare.router.prefix_index import PoolPrefixIndex

    ids = list(range(64))
    index = PoolPrefixIndex((E.MEDIUM_GPU, None))
    index.apply(
        E.BlockStored(
            block_hashes=[1, 2],
            parent_block_hash=None,
            token_ids=ids,
            block_size=32,
            lora_id=None,
            medium=E.MEDIUM_GPU,
            lora_name=None,
            extra_keys=[None, None],
        )
    )
    assert index.held_tokens(ids, None) == 64
    salted = PoolPrefixIndex((E.MEDIUM_GPU, None))  # vLLM keys a cache_salt into the first block only
    salted.apply(
        E.BlockStored(
            block_hashes=[1, 2],
            parent_block_hash=None,
            token_ids=ids,
            block_size=32,
            lora_id=None,
            medium=E.MEDIUM_GPU,
            lora_name=None,
            extra_keys=[("salt",), None],
        )
    )
    assert salted.held_tokens(ids, None) == 0


def test_the_placer_records_what_a_split_needs_and_nothing_for_a_salted_prompt():
    """Fails when a salted prompt's pool prefix (0: the events name no salted page) is taken as what the pool
    held: its cached tokens would be called the replica's own."""
    from kvshare.pool import events as E
    from tests.router.test_pool_aware import FakeFeed, placer_with, stored_chain, views

    prompt = list(range(4000, 4000 + 512))
    router = placer_with(stored_chain(prompt[:256]))
    gpu = FakeFeed([])
    gpu.index.media = (E.MEDIUM_GPU,)
    gpu.index.apply(
        E.BlockStored(
            block_hashes=[9],
            parent_block_hash=None,
            token_ids=prompt[:256],
            block_size=256,
            lora_id=None,
            medium=E.MEDIUM_GPU,
            lora_name=None,
        )
    )
    router.pool_aware.replica_feeds = [FakeFeed([]), gpu]
    router.choose(RouteFacts(prompt_ids=prompt), views(0, 0), now=0.0)
    placement = router.pool_aware.last_placement
    assert (placement.num_tokens, placement.pool_tokens, placement.own_tokens) == (512, 256, [0, 256])
    router.choose(RouteFacts(prompt_ids=prompt, cache_salt="tenant"), views(0, 0), now=0.0)
    placement = router.pool_aware.last_placement
    assert (placement.pool_tokens, placement.own_tokens) == (None, [None, None])


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("piece_bytes", [7, 100, 1 << 20])
def test_a_usage_chunk_the_router_asked_for_is_taken_out_to_the_byte(kind, piece_bytes):
    """Fails when the terminal chunk does not get back the system_fingerprint that vLLM leaves off it when a
    usage chunk follows, or when the usage chunk reaches the client."""
    asked, unasked = STREAMS[f"{kind}_with_usage"], STREAMS[kind]
    strip, out = UsageStrip(), b""
    for start in range(0, len(asked), piece_bytes):
        out += strip.feed(asked[start : start + piece_bytes])
    assert out + strip.close() == unasked


def test_a_stream_cut_before_its_usage_chunk_is_passed_on_whole():
    asked = STREAMS["completion_with_usage"]
    cut = asked[
        : asked.index(
            b'data: {"id":"cmpl-fixed","object":"text_completion","created":1796515724,"model":"tiny","choices":[]'
        )
    ]
    strip = UsageStrip()
    assert strip.feed(cut) + strip.close() == cut


def test_the_router_asks_for_usage_only_where_the_client_did_not_and_one_stream_answers():
    """Fails when a client's own stream_options are lost, or usage is asked for a batch, n > 1 or no stream."""
    body = json.dumps({"prompt": "hi", "stream": True, "stream_options": {"other": 1}}).encode()
    assert json.loads(ask_for_usage("POST", "/v1/completions", body))["stream_options"] == {
        "other": 1,
        "include_usage": True,
    }
    chat = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True, "n": 1}).encode()
    asked = json.loads(ask_for_usage("POST", "/v1/chat/completions", chat))
    assert asked["stream_options"] == {"include_usage": True} and asked["messages"][0]["content"] == "x"
    assert json.loads(ask_for_usage("POST", "/v1/completions", b'{"prompt":[1,2],"stream":true}'))["prompt"] == [1, 2]
    for body in (
        b'{"prompt":"hi","stream":true,"stream_options":{"include_usage":true}}',  # the client reads it
        b'{"prompt":"hi","stream":true,"stream_options":{"continuous_usage_stats":true}}',
        b'{"prompt":"hi","stream":false}',
        b'{"prompt":"hi"}',
        b'{"prompt":"hi","stream":true,"n":2}',
        b'{"prompt":["a","b"],"stream":true}',
        b'{"prompt":[[1],[2]],"stream":true}',
        b'{"prompt":"hi","stream":true,"stream_options":[]}',
        b'{"prompt": "hi", "stream": tru',
    ):
        assert ask_for_usage("POST", "/v1/completions", body) is None, body
    assert ask_for_usage("POST", "/v1/embeddings", b'{"input":"x","stream":true}') is None


def test_a_pool_aware_router_in_front_of_a_vllm_replica_measures_it_and_relays_its_stream_unchanged():
    """A replica that answers as vLLM 0.32 did (the recorded streams, by whether the body asks for usage): a
    client that does not ask gets exactly the unasked stream, one that asks the asked one, and both responses
    are prefill samples. Fails when the router does not ask for the usage (the replica is not asked for it, and
    the first response is no sample)."""
    from aiohttp import web

    bodies = []

    async def completions(request):
        body = await request.json()
        bodies.append(body)
        is_asked = (body.get("stream_options") or {}).get("include_usage")
        stream = STREAMS["completion_with_usage" if is_asked else "completion"].replace(
            b'"cached_tokens":128', b'"cached_tokens":0'
        )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        first, rest = stream.split(b"\n\n", 1)
        await response.write(first + b"\n\n")
        await response.write(rest)
        await response.write_eof()
        return response

    def relayed(router_url: str, **extra) -> bytes:
        body = {"model": "tiny", "prompt": list(range(1, 136)), "max_tokens": 3, "stream": True, **extra}
        request = urllib.request.Request(
            router_url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.read()

    with LiveApp(replica_app(completions)) as replica_url:
        config = RouterConfig(
            replicas=(replica_url,),
            policy="pool_aware",
            engine="vllm",
            pool_aware=PoolAwareConfig(endpoint="tcp://127.0.0.1:1", model="tiny", cost=FLAGS),
        )
        server = RouterServer(config)
        with LiveApp(server.app()) as router_url:
            assert relayed(router_url) == STREAMS["completion"]
            asked = relayed(router_url, stream_options={"include_usage": True})
            samples = server.pool_aware.calibration.replicas[0]
            for _ in range(100):  # the relay records the end after the last write
                if len(samples.samples) == 2:
                    break
                time.sleep(0.02)
    assert asked == STREAMS["completion_with_usage"].replace(b'"cached_tokens":128', b'"cached_tokens":0')
    assert [b.get("stream_options") for b in bodies] == [{"include_usage": True}] * 2
    assert [(computed, pool) for computed, pool, _ in samples.samples] == [(135, 0), (135, 0)]
