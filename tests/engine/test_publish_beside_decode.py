"""A prompt is stored (local cache, pool) beside its decode steps, and its stream ends only once it is stored."""

from __future__ import annotations

import threading

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from tests.engine.conftest import ascii_prompt
from tests.engine.test_reuse import COLD, run

CHUNK = 16
NO_LOCAL = RequestOptions(use_local_cache=False)


def _held_publish(engine: Engine) -> tuple[threading.Event, threading.Event]:
    """Make the engine's publish wait for ``release``; ``done`` is set once it has stored."""
    release, done = threading.Event(), threading.Event()
    publish = engine._publish

    def held(*args):
        assert release.wait(30)
        publish(*args)
        done.set()

    engine._publish = held
    return release, done


def test_tokens_do_not_wait_for_the_store_but_the_last_one_does(pool_socket):
    """All tokens but the last arrive while the store is held back; the last one (a response's end, after which
    a client sends its next turn to any replica) only once the prompt is stored."""
    writer = Engine(EngineConfig(model="tiny", chunk_tokens=CHUNK, pool_socket=pool_socket))
    reader = Engine(EngineConfig(model="tiny", chunk_tokens=CHUNK, pool_socket=pool_socket))
    ids = writer.tokenizer.encode(ascii_prompt(75, seed=11))
    cold, _ = run(reader, ids, COLD)
    release, done = _held_publish(writer)
    stream = writer.generate(ids, SamplingParams(max_tokens=len(cold), ignore_eos=True))
    tokens, stored_at_last, ended = [], [], threading.Event()

    def consume():
        for event in stream:
            tokens.append(event.token_id)
            if event.finish_reason is not None:
                stored_at_last.append(done.is_set())
        ended.set()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    for _ in range(1000):  # up to 10 s for the tokens before the last
        if len(tokens) == len(cold) - 1:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)
    assert tokens == cold[:-1] and not done.is_set() and not ended.is_set()
    release.set()
    assert ended.wait(30) and tokens == cold and stored_at_last == [True]
    # what was stored is the prompt's KV: the other engine loads it and generates what a recompute does
    assert run(reader, ids, NO_LOCAL) == (cold, (0, 64, 11))


def test_a_one_token_response_is_not_held_for_the_store(pool_socket):
    """The first token never waits for the store, also when it is the last: the stream ends after the store."""
    engine = Engine(EngineConfig(model="tiny", chunk_tokens=CHUNK, pool_socket=pool_socket))
    ids = engine.tokenizer.encode(ascii_prompt(40, seed=13))
    release, done = _held_publish(engine)
    stream = engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    event = next(stream)
    assert event.finish_reason == "length" and not done.is_set()
    release.set()
    assert list(stream) == [] and done.is_set()


def test_a_failed_store_is_the_requests_error_and_the_engine_serves_on(pool_socket):
    engine = Engine(EngineConfig(model="tiny", chunk_tokens=CHUNK, pool_socket=pool_socket))
    ids = engine.tokenizer.encode(ascii_prompt(40, seed=12))
    publish = engine._publish

    def broken(*args):
        raise RuntimeError("the store broke")

    engine._publish = broken
    stream = engine.generate(ids, SamplingParams(max_tokens=3, ignore_eos=True))
    try:
        list(stream)
    except RuntimeError as exc:
        assert "the store broke" in str(exc)
    else:
        raise AssertionError("the store's error was lost")
    engine._publish = publish
    cold, _ = run(engine, ids, COLD)
    assert run(engine, ids) == (cold, (0, 0, 40))


def test_the_local_copies_run_beside_the_pool_store(pool_socket):
    """The local cache's copies and the pool's store of one prompt overlap (each waits here for the other to
    have started: run one after the other, the first would wait in vain), and both keep the prompt's KV."""
    writer = Engine(
        EngineConfig(
            model="tiny", chunk_tokens=CHUNK, pool_socket=pool_socket, local_cache_bytes=1 << 24, reuse_in_place=False
        )
    )
    reader = Engine(EngineConfig(model="tiny", chunk_tokens=CHUNK, pool_socket=pool_socket))
    ids = writer.tokenizer.encode(ascii_prompt(75, seed=14))
    cold, _ = run(reader, ids, COLD)
    local_started, pool_started, overlapped = threading.Event(), threading.Event(), []
    insert, store = writer._local.insert, writer._pool.store

    def waiting_insert(*args):
        local_started.set()
        overlapped.append(pool_started.wait(10))
        return insert(*args)

    def waiting_store(*args, **kwargs):
        pool_started.set()
        overlapped.append(local_started.wait(10))
        return store(*args, **kwargs)

    writer._local.insert, writer._pool.store = waiting_insert, waiting_store
    assert run(writer, ids) == (cold, (0, 0, 75))  # nothing of it held yet: computed, then stored both ways
    assert overlapped == [True] * 5  # 4 chunks inserted, 1 store
    writer._local.insert, writer._pool.store = insert, store
    assert run(writer, ids) == (cold, (64, 0, 11))  # the local cache holds the prompt's 4 full chunks
    assert run(reader, ids, NO_LOCAL) == (cold, (0, 64, 11))  # and the pool too
