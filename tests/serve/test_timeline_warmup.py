"""A request's timeline and a replica's warm-up, on real replicas of the tiny model against one pool.

Replica A computes a prompt cold and stores it; replica B (warmed up first) loads it from the pool;
both answer through a router too. A request that asks (``{"kvshare": {"timeline": true}}``) gets the
seconds since its arrival of each step, in the streamed last chunk's ``kvshare`` object or the body's.
B reports healthy (and announces itself ready) only once its warm-up has loaded from the pool.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import numpy as np
import pytest

from kvshare.engine.timeline import STEPS, Timeline
from kvshare.engine.warmup import WARMUP_CHUNKS, warm_up, warmup_prompts
from kvshare.serve.readiness import Readiness
from tests.serve.live import LiveApp, call, metric

ORDER = (
    "body_read",
    "parse",
    "hashing",
    "lookup_and_lease",
    "first_copy_enqueued",
    "load_issued",
    "first_layer_computed",
    "forward_end",
    "first_token_sampled",
    "first_token_written",
)  # each at or after
# the one before; load_end lies before forward_end, load_checked between load_end and first_token_sampled (on
# CUDA the host may know the check before the device ends the forward)
LOAD_STEPS = ("first_copy_enqueued", "load_started", "load_issued", "load_end", "load_checked")


@pytest.fixture(scope="module")
def replicas():
    """(A url, B url, router url, B's warm-up gate, B's readiness, B's ready-line calls) with one pool."""
    from kvshare.engine.engine import Engine, EngineConfig
    from kvshare.pool.spawn import running_pool
    from kvshare.router.config import RouterConfig
    from kvshare.router.server import RouterServer
    from kvshare.serve.config import ServeConfig
    from kvshare.serve.server import ReplicaServer

    gate = threading.Event()
    announced: list[str] = []

    def slow_warm_up(engine):  # the test holds B's warm-up until it has seen /health answer 503
        assert gate.wait(120), "the test never released the warm-up"
        return warm_up(engine)

    with running_pool("256MiB", quiet=True) as sock:
        # whole chunks only: A's local request is a hit of its local cache (its copies are a step of the timeline)
        make = lambda: Engine(
            EngineConfig(
                model="tiny", pool_socket=sock, local_cache_bytes=64 << 20, verify_checksums=True, reuse_in_place=False
            )
        )
        server_a = ReplicaServer(make(), ServeConfig(replica_name="A", provenance="all"))
        server_b = ReplicaServer(
            make(), ServeConfig(replica_name="B", warmup=True, provenance="all"), warm_up=slow_warm_up
        )
        server_b.readiness.on_ready = lambda: announced.append("ready")
        with LiveApp(server_a.app()) as a, LiveApp(server_b.app()) as b:
            server_b.readiness.listening()  # what run_app's print callback does in kvshare serve
            router = RouterServer(RouterConfig(replicas=(a, b), policy="round_robin"))
            with LiveApp(router.app()) as r:
                yield a, b, r, gate, server_b.readiness, announced
            server_a.engine.close()
            server_b.engine.close()


def wait_until_router_sees_all_healthy(router: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status, health = call(router, "/health")
        if status == 200 and all(r["healthy"] for r in health["replicas"]):
            return
        assert time.monotonic() < deadline, f"the router never saw every replica healthy: {health}"
        time.sleep(0.1)


def prompt(seed: int, n: int = 1500) -> list[int]:
    return np.random.default_rng(seed).integers(0, 250, n).tolist()


def stream(url: str, ids: list[int], timeline: bool = True) -> dict:
    """The ``kvshare`` object of a streamed completion (from the last chunk that carries one)."""
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "stream": True, "kvshare": {"timeline": timeline}}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    found = None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: {"):
                found = json.loads(line[6:]).get("kvshare", found)
    assert found is not None, "no chunk carried the kvshare object"
    return found


def check_order(timeline: dict) -> None:
    assert tuple(timeline) == STEPS
    times = [timeline[s] for s in ORDER if timeline[s] is not None]
    assert times == sorted(times) and all(t >= 0 for t in times), timeline
    if timeline["load_end"] is not None:
        assert timeline["lookup_and_lease"] <= timeline["load_started"] <= timeline["load_end"], timeline
        assert timeline["lookup_and_lease"] <= timeline["load_end"] <= timeline["forward_end"], timeline
        assert timeline["load_end"] <= timeline["load_checked"] <= timeline["first_token_sampled"], timeline


def test_health_is_503_until_the_warm_up_loaded_from_the_pool(replicas):
    a, b, _, gate, readiness, announced = replicas
    status, health = call(b, "/health")
    assert (status, health["status"]) == (503, "warming up") and announced == []
    assert call(a, "/health")[0] == 200  # A was started without a warm-up
    gate.set()
    for _ in range(600):
        status, health = call(b, "/health")
        if status == 200:
            break
        threading.Event().wait(0.1)
    assert (status, health["status"]) == (200, "ok") and announced == ["ready"]
    warmup = health["warmup"]
    assert warmup["pool_chunks_stored"] >= WARMUP_CHUNKS + 1 and warmup["pool_chunks_loaded"] >= 2 * WARMUP_CHUNKS
    # the request path ran too (decode, sampler's logprobs, the response's chunks), after the engine's steps
    assert warmup["step_seconds"]["request_path"] > 0
    # its requests are not counted, and its chunks left the pool again
    assert metric(b, "kvshare_pool_hit_chunks_total") in (0.0, None)
    assert metric(b, "kvshare_prompt_tokens_total") in (0.0, None)
    assert metric(b, "kvshare_generation_tokens_total") in (0.0, None)


def test_timeline_of_a_cold_a_cross_replica_and_a_local_request(replicas):
    a, b, _, gate, readiness, _ = replicas
    gate.set()
    assert readiness.report is not None or call(b, "/health")[0] in (200, 503)
    ids = prompt(1)
    cold, cross, local = stream(a, ids), stream(b, ids), stream(a, ids)
    assert (cold["computed_tokens"], cross["pool_tokens"], local["local_tokens"]) == (1500, 1280, 1280)
    for answer in (cold, cross, local):
        check_order(answer["timeline"])
        assert all(
            answer["timeline"][s] is not None
            for s in (
                "body_read",
                "parse",
                "hashing",
                "first_layer_computed",
                "forward_end",
                "first_token_sampled",
                "first_token_written",
                "published",
            )
        )
        # the prompt is offered to the local cache and the pool after the first token, never before it
        assert answer["timeline"]["published"] >= answer["timeline"]["first_token_sampled"], answer["timeline"]
    assert all(cold["timeline"][s] is None for s in LOAD_STEPS)  # nothing loaded
    assert cold["timeline"]["lookup_and_lease"] is not None  # the pool was asked, and held nothing
    assert all(cross["timeline"][s] is not None for s in LOAD_STEPS)
    assert local["timeline"]["lookup_and_lease"] is None  # the local cache held every reusable chunk
    # the local cache's copies are a step of the local hit only, after the hashing and before the forward
    assert cold["timeline"]["local_copied"] is None and cross["timeline"]["local_copied"] is None
    assert local["timeline"]["hashing"] <= local["timeline"]["local_copied"] <= local["timeline"]["forward_end"]


def test_timeline_through_the_router_and_not_asked(replicas):
    a, b, r, gate, _, _ = replicas
    gate.set()
    wait_until_router_sees_all_healthy(r)  # B answered 503 while it warmed up: round robin skips it until re-probed
    ids = prompt(2)
    first = stream(r, ids)
    second = stream(r, ids)  # round robin: the other replica, which loads from the pool
    assert {first["replica"], second["replica"]} == {"A", "B"} and second["pool_tokens"] == 1280
    check_order(second["timeline"])
    assert all(second["timeline"][s] is not None for s in LOAD_STEPS)
    assert "timeline" not in stream(a, prompt(3), timeline=False)
    status, body = call(a, "/v1/completions", {"prompt": prompt(4), "max_tokens": 2, "kvshare": {"timeline": True}})
    assert status == 200 and body["kvshare"]["timeline"]["first_token_written"] is None  # the body is the first write
    check_order(body["kvshare"]["timeline"])


def test_timeline_marks_once_and_freezes_when_read():
    clock = iter([1.0, 1.5, 2.0, 9.0]).__next__
    t = Timeline(arrival_s=0.5, clock=clock)
    t.mark("parse")
    t.mark("parse")  # the first mark wins
    t.mark("forward_end")
    out = t.as_dict()
    assert out["parse"] == 0.5 and out["forward_end"] == 1.0 and out["first_layer_computed"] == 1.0  # one layer
    t.mark("hashing", at=9.0)
    assert t.as_dict() == out and t.is_closed
    with pytest.raises(ValueError, match="unknown timeline step"):
        Timeline(0.0).mark("nope")


def test_readiness_announces_once_listening_and_warm_in_either_order():
    calls: list[str] = []
    ready = Readiness(is_warming_up=True, on_ready=lambda: calls.append("ready"))
    ready.run_warmup(lambda engine: None, engine=None)
    assert calls == [] and ready.is_ready  # not listening yet
    ready.listening()
    ready.listening()
    assert calls == ["ready"]
    failed: list[BaseException] = []
    broken = Readiness(is_warming_up=True, on_ready=lambda: calls.append("x"), on_failed=failed.append)
    broken.listening()
    broken.run_warmup(lambda engine: 1 / 0, engine=None)
    assert not broken.is_ready and broken.status == "warm-up failed" and len(failed) == 1
    assert "ZeroDivisionError" in broken.health_fields()["error"] and calls == ["ready"]


def test_warmup_prompts_reuse_whole_chunks_and_fit_the_context():
    full, partial = warmup_prompts(256, 260, 32768)
    assert len(full) == (WARMUP_CHUNKS + 1) * 256 and partial == full[: WARMUP_CHUNKS * 256 + 128]
    short = warmup_prompts(256, 260, 600)  # two chunks and two tokens do not fit: one chunk reused
    assert len(short[0]) == 512 and all(len(p) + 2 < 600 for p in short)
    assert [len(p) for p in warmup_prompts(256, 260, 200)] == [197]  # no whole chunk fits: a prefill only


@pytest.mark.parametrize("max_prompt_tokens", [None, 3000])
def test_request_path_warm_up_decodes_a_body_of_the_longest_prompt(monkeypatch, max_prompt_tokens):
    from kvshare.engine.engine import Engine, EngineConfig
    from kvshare.serve import api_types as A
    from kvshare.serve.warm_path import warm_request_path

    decoded: list[list[int]] = []
    decode = A.decode_completion
    monkeypatch.setattr(A, "decode_completion", lambda body: decoded.append(A.prompt_of(decode(body))) or decode(body))
    engine = Engine(EngineConfig(model="tiny"))
    try:
        warm_request_path(engine, "tiny", "r", max_prompt_tokens)
        stats = engine.stats()
    finally:
        engine.close()
    vocab, longest = engine.model_config.vocab_size, min(max_prompt_tokens or 1 << 62, engine.max_model_len - 1)
    assert [len(p) for p in decoded[-1:]] == [longest]  # after the two small requests: the longest body
    assert 0 <= min(decoded[-1]) and max(decoded[-1]) < vocab and len(set(decoded[-1])) > vocab // 2
    assert stats.num_requests == 0  # nothing of it is counted


@pytest.mark.parametrize("model", ["tiny", "qwen3.5-tiny"])  # a hybrid: each suffix from its prefix's GDN state
def test_suffix_kernel_warm_up_runs_each_shape_and_leaves_outputs_alone(model):
    from kvshare.engine.engine import Engine, EngineConfig, SamplingParams
    from kvshare.engine.warmup import warm_suffix_kernels

    engine = Engine(EngineConfig(model=model, max_model_len=512))
    ids = prompt(9, 300)
    params = SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True)
    try:
        before = [(e.token_id, e.logprob) for e in engine.generate(ids, params)]
        assert warm_suffix_kernels(engine, prefixes=(64, 69, 600), lengths=(1, 3, 16)) == 6  # 600 does not fit
        assert warm_suffix_kernels(engine, prefixes=(600,), lengths=(1,)) == 0
        again = [(e.token_id, e.logprob) for e in engine.generate(ids, params)]
    finally:
        engine.close()
    assert again == before


def test_request_path_warm_up_compiles_the_chat_template():
    """After the warm-up a replica's first chat compiles no template (fails when warm_request_path leaves out the
    tokenizer's warm-up: the first text request then compiles it inside its parse, ~25 ms on 2 cores)."""
    from kvshare.engine.engine import Engine, EngineConfig
    from kvshare.engine.tokenizer import _compiled_chat_template
    from kvshare.serve import api_types as A
    from kvshare.serve.tokenize import chat_prompt_ids
    from kvshare.serve.warm_path import warm_request_path

    engine = Engine(EngineConfig(model="tiny"))
    try:
        _compiled_chat_template.cache_clear()
        warm_request_path(engine, "tiny", "r", 600)
        compiled_by_warm_up = _compiled_chat_template.cache_info().misses
        chat_prompt_ids(engine.tokenizer, [A.ChatMessage(role="user", content="hello")])
    finally:
        engine.close()
    assert compiled_by_warm_up == 1 and _compiled_chat_template.cache_info().misses == 1
