"""State checkpoints through the remote tier: written behind like pages, and promoted for a lookup whose run reaches
past the arena's checkpoints, as checkpoints again (counted apart, never announced); bytes on pool B equal pool A's."""

import numpy as np
import pytest

from kvshare.keys import state_key
from kvshare.pool import protocol as P
from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolClient
from tests.pool.remote.conftest import (
    NAMESPACE,
    make_keys,
    page_data,
    remote_stats,
    two_pools,
    wait_written,
    write_chain,
)

pytestmark = pytest.mark.remote
MiB = 1 << 20
PAGE = 256 << 10
STATE = 3 * MiB // 2


def write_states(client: PoolClient, chunk_keys: list[bytes], tag: str) -> list[np.ndarray]:
    keys = [state_key(k) for k in chunk_keys]
    data = [page_data(tag, i, STATE) for i in range(len(keys))]
    reservation = client.reserve(NAMESPACE, keys, STATE, holds_states=True)
    sums = []
    for i, offset in reservation.grants:
        client.page(offset, STATE)[:] = data[i]
        sums.append(page_checksum(data[i]))
    client.commit(reservation.reservation_id, sums)
    return data


def candidates(chunk_keys: list[bytes]) -> list[P.StateCandidate]:
    n = len(chunk_keys)
    return [P.StateCandidate(key=state_key(chunk_keys[j - 1]), num_kv=j) for j in range(n, 0, -1)]


def test_a_checkpoint_travels_through_the_store_with_its_kv_pages(redis_server, prefix):
    with two_pools(redis_server.url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        chunks = make_keys("s", 4)
        write_chain(ca, chunks, PAGE, "s")
        stored = write_states(ca, [chunks[1], chunks[3]], "s-state")  # after 2 and after 4 chunks
        wait_written(ca, 6)
        grant = cb.lookup(chunks, PAGE, states=candidates(chunks), state_page_bytes=STATE)
        assert grant.num_pages == 4 and grant.state is not None and grant.state.index == 0  # after 4 chunks
        page = grant.state.page
        assert np.array_equal(cb.page(page.offset, STATE), stored[1])  # bytes loaded == bytes stored
        stats = cb.stats()
        assert (stats["checkpoints"], stats["checkpoint_bytes"]) == (1, STATE)  # promoted as a checkpoint
        assert remote_stats(cb)["promoted_pages"] == 5
        cb.release([grant.lease_id], wait=True)
        cb.check_integrity()


def test_a_checkpoint_only_the_store_holds_is_found_past_the_arenas(redis_server, prefix):
    """Pool B holds the KV pages and a shallow checkpoint; the store also holds a deeper one: that one is used."""
    with two_pools(redis_server.url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        chunks = make_keys("t", 3)
        write_chain(ca, chunks, PAGE, "t")
        deep = write_states(ca, [chunks[2]], "t-deep")
        wait_written(ca, 4)
        write_chain(cb, chunks, PAGE, "t")
        write_states(cb, [chunks[0]], "t-shallow")
        grant = cb.lookup(chunks, PAGE, states=candidates(chunks), state_page_bytes=STATE)
        assert grant.state.index == 0 and np.array_equal(cb.page(grant.state.page.offset, STATE), deep[0])
        cb.release([grant.lease_id], wait=True)
        nothing_deeper = cb.lookup(chunks[:1], PAGE, states=candidates(chunks)[2:], state_page_bytes=STATE)
        assert nothing_deeper.state.index == 0  # the arena's own, found at once
        cb.release([nothing_deeper.lease_id], wait=True)


def test_a_hybrid_engine_on_pool_b_resumes_from_a_checkpoint_pool_a_wrote(redis_server, prefix):
    import torch

    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, RequestOptions, SamplingParams

    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompt = torch.randint(0, 256, (3 * 64 + 20,), generator=torch.Generator().manual_seed(5)).tolist()
    config = dict(model="qwen3.5-tiny", chunk_tokens=64, verify_checksums=True, max_model_len=512)

    def run(engine, options=RequestOptions(use_local_cache=False)):
        events = list(engine.generate(prompt, params, options))
        return [e.token_id for e in events], events[0].provenance

    with two_pools(redis_server.url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        engine_a = Engine(EngineConfig(pool_socket=a, **config))
        run(engine_a)
        wait_written(ca, 3 + 1)  # three KV pages and the checkpoint at the last whole chunk
        size = engine_a.model.state.layout.checkpoint_bytes
        key = state_key(engine_a.prompt_chunk_keys(prompt)[2])
        written = ca.lookup([key], size, lease=False).pages[0]
        stored = ca.page(written.offset, size).copy()
        engine_a.close()
        engine_b = Engine(EngineConfig(pool_socket=b, **config))
        reused, provenance = run(engine_b)
        assert provenance.pool_tokens == 3 * 64 and engine_b.stats().pool_states_loaded == 1
        promoted = cb.lookup([key], size, lease=False).pages[0]
        assert np.array_equal(cb.page(promoted.offset, size), stored)  # bytes loaded == bytes stored
        assert reused == run(engine_b, RequestOptions(use_pool=False, use_local_cache=False))[0]
        engine_b.close()
