"""Reuse must not change outputs: cold == local reuse == pool reuse by another process (greedy ids, float32)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.keys import chunk_keys, namespace_digest
from kvshare.pool.client import PoolClient
from tests.engine.conftest import ascii_prompt

CHUNK = 16
COLD = RequestOptions(use_pool=False, use_local_cache=False)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
LENGTHS = (64, 75)  # a multiple of the chunk size (its last chunk is recomputed) and not


def run(engine: Engine, ids: list[int], options: RequestOptions = RequestOptions(), params=PARAMS):
    events = list(engine.generate(ids, params, options))
    p = events[0].provenance
    return [e.token_id for e in events], (p.local_tokens, p.pool_tokens, p.computed_tokens)


def reused_tokens(n: int, chunk: int = CHUNK) -> int:
    """Full chunks that can be reused while leaving at least one prompt token to compute."""
    return min(n // chunk, (n - 1) // chunk) * chunk


@pytest.fixture(scope="module")
def prompts():
    return {n: ascii_prompt(n, seed=n) for n in LENGTHS}


def test_local_reuse_equals_cold(tiny_dir, prompts):
    engine = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, reuse_in_place=False))  # the local cache's
    for n, text in prompts.items():
        ids = engine.tokenizer.encode(text)
        assert len(ids) == n
        cold, provenance = run(engine, ids, COLD)
        assert provenance == (0, 0, n)
        assert run(engine, ids) == (cold, (0, 0, n))  # first sight: computed, then kept locally
        r = reused_tokens(n)
        assert run(engine, ids) == (cold, (r, 0, n - r))
    # a prompt sharing only its first two chunks reuses exactly those
    ids = engine.tokenizer.encode(prompts[64][:32] + ascii_prompt(40, seed=99))
    cold, _ = run(engine, ids, COLD)
    assert run(engine, ids) == (cold, (32, 0, 40))
    stats = engine.stats()
    # the third prompt shares two chunks
    assert stats.prompt_tokens_local == 48 + 64 + 32 and stats.local_cache_chunks == 4 + 4 + 2


def test_local_cache_bound_and_option(tiny_dir, prompts):
    page = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK)).layout.page_bytes
    engine = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, local_cache_bytes=2 * page, reuse_in_place=False))
    ids = engine.tokenizer.encode(prompts[75])
    cold, _ = run(engine, ids, COLD)
    run(engine, ids)
    assert engine.stats().local_cache_bytes == 2 * page  # the head of the prefix is what stays
    assert run(engine, ids) == (cold, (32, 0, 43))
    assert run(engine, ids, RequestOptions(use_local_cache=False)) == (cold, (0, 0, 75))


def test_a_local_cache_the_device_cannot_hold_never_fails_a_request(tiny_dir, prompts, pool_socket, monkeypatch):
    """The H200 run of 2026-12-01 at 237d68f: two replicas on one GPU, each with a local cache too
    large for what the other left, failed requests after their tokens were generated (OOM in the
    local insert). Now the request completes with the cold tokens, the pool still gets the prompt,
    and the cache stops at what it held."""
    from kvshare.engine import prefix_cache

    engine = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, reuse_in_place=False))
    ids = engine.tokenizer.encode(prompts[75])
    cold, _ = run(engine, ids, COLD)
    real = prefix_cache._copy_of

    def room_for_two(chunk):  # the device holds two chunks beside everything else
        if len(engine._local) >= 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 36.00 MiB.")
        return real(chunk)

    monkeypatch.setattr(prefix_cache, "_copy_of", room_for_two)
    assert run(engine, ids) == (cold, (0, 0, 75))  # completed, though the device had room for 2 of 4 chunks
    stats = engine.stats()
    assert stats.local_cache_chunks == 2 and stats.pool_stored_chunks == 75 // CHUNK
    assert engine._local.capacity_bytes == 2 * engine.layout.page_bytes
    # what /metrics shows (kvshare_local_cache_out_of_memory_total, kvshare_local_cache_capacity_bytes)
    assert stats.local_out_of_memory == 1 and stats.local_cache_capacity_bytes == 2 * engine.layout.page_bytes
    # the cache kept the prompt's head (tails make room first): the next request takes it locally,
    # the rest from the pool, and computes the same tokens
    assert run(engine, ids) == (cold, (32, 32, 11))


def test_pool_reuse_by_a_second_process(tiny_dir, prompts, pool_socket, tmp_path):
    a = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True))
    cold = {}
    for n, text in prompts.items():
        ids = a.tokenizer.encode(text)
        cold[n], _ = run(a, ids, COLD)
        assert run(a, ids) == (cold[n], (0, 0, n))  # computed, then stored in the pool
    assert a.stats().pool_stored_chunks == sum(n // CHUNK for n in LENGTHS)
    for n, text in prompts.items():  # a process that never saw the prompts
        prompt_file = tmp_path / f"prompt{n}.txt"
        prompt_file.write_text(text)
        cmd = [
            sys.executable,
            "-m",
            "kvshare",
            "generate",
            "--model",
            tiny_dir,
            "--pool",
            pool_socket,
            "--chunk-tokens",
            str(CHUNK),
            "--prompt-file",
            str(prompt_file),
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--verify-checksums",
            "--json",
        ]
        out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout)
        r = reused_tokens(n)
        assert out["token_ids"] == cold[n]
        assert out["provenance"] == {"local_tokens": 0, "pool_tokens": r, "computed_tokens": n - r}


def test_pool_bytes_loaded_equal_bytes_stored(tiny_dir, prompts, pool_socket):
    a = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True))
    b = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True))
    ids = a.tokenizer.encode(prompts[75])
    keys = chunk_keys(namespace_digest(a.namespace), ids, CHUNK)
    run(a, ids, RequestOptions(use_pool=False))  # computed; kept in a's local cache only
    run(a, ids, RequestOptions(use_local_cache=False))  # ... and stored in the pool (it lacked them)
    tokens, provenance = run(b, ids)
    assert provenance == (0, 64, 11)
    stored = a._local.longest_prefix(keys)
    loaded = b._local.longest_prefix(keys)  # b's copies of its sequence KV after the load
    assert len(stored) == len(loaded) == 4
    with PoolClient(pool_socket) as client:
        pages = client.lookup(keys, a.layout.page_bytes, lease=False).pages
        for s, l, page in zip(stored, loaded, pages):
            assert torch.equal(s.view(torch.int32), l.view(torch.int32))  # bitwise
            raw = torch.from_numpy(client.page(page.offset, page.page_bytes).copy()).view(torch.float32)
            canonical = raw.view(a.layout.page_shape)  # [L, 2, C, H, D]
            assert torch.equal(canonical, s.transpose(2, 3))


def test_default_chunk_size_and_tenants(tiny_dir, pool_socket):
    a = Engine(EngineConfig(model=tiny_dir, pool_socket=pool_socket, verify_checksums=True))
    b = Engine(EngineConfig(model=tiny_dir, pool_socket=pool_socket, verify_checksums=True))
    assert a.layout.chunk_tokens == 256
    ids = a.tokenizer.encode(ascii_prompt(600, seed=5))
    cold, _ = run(a, ids, COLD)
    assert run(a, ids) == (cold, (0, 0, 600))
    assert run(b, ids, RequestOptions(tenant="someone else")) == (cold, (0, 0, 600))  # salted keys: no hit
    assert run(b, ids, RequestOptions(use_local_cache=False)) == (cold, (0, 512, 88))
    assert run(b, ids, RequestOptions(use_pool=False)) == (cold, (0, 0, 600))
    stats = b.stats()
    assert stats.prompt_tokens_pool == 512 and stats.pool_bytes_loaded == 2 * b.layout.page_bytes


def test_a_stream_closed_after_its_first_token_still_publishes(tiny_dir, pool_socket):
    a = Engine(
        EngineConfig(
            model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True, reuse_in_place=False
        )
    )
    b = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True))
    ids = a.tokenizer.encode(ascii_prompt(40, seed=21))
    cold, _ = run(a, ids, COLD)
    events = a.generate(ids, PARAMS)
    next(events)
    events.close()  # a client that went away after the first token
    assert a.stats().pool_stored_chunks == 2 and a.stats().local_cache_chunks == 2
    assert run(b, ids, RequestOptions(use_local_cache=False)) == (cold, (0, 32, 8))
    assert run(a, ids) == (cold, (32, 0, 8))  # and the lock was released
