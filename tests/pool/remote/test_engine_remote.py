"""An engine on pool B reuses a prefix an engine on pool A computed, through the store; output == cold compute."""

import pytest

from kvshare.pool.client import PoolClient
from tests.pool.remote.conftest import remote_stats, two_pools, wait_written

pytestmark = pytest.mark.remote
CHUNK = 32


def test_engine_on_pool_b_reuses_prefix_from_pool_a_via_store(redis_server, prefix):
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, RequestOptions, SamplingParams

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cold_options = RequestOptions(use_pool=False, use_local_cache=False)
    text = "".join(chr(32 + (i * 37) % 95) for i in range(140))  # 140 byte tokens: 4 full chunks + a tail

    def run(engine, ids, options=RequestOptions()):
        events = list(engine.generate(ids, params, options))
        return [e.token_id for e in events], events[0].provenance

    with two_pools(redis_server.url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        config = dict(model="tiny", chunk_tokens=CHUNK, verify_checksums=True, max_model_len=512)
        engine_a = Engine(EngineConfig(pool_socket=a, **config))
        ids = engine_a.tokenizer.encode(text)
        _, provenance = run(engine_a, ids)
        assert provenance.computed_tokens == len(ids)
        num_chunks = len(ids) // CHUNK
        wait_written(ca, num_chunks)
        assert remote_stats(ca)["prefill_reports"] == 1  # the cold prefill's time, for cost-aware promotion
        engine_a.close()

        engine_b = Engine(EngineConfig(pool_socket=b, **config))
        reused, provenance = run(engine_b, ids)
        assert provenance.pool_tokens == num_chunks * CHUNK > 0 and provenance.local_tokens == 0
        assert provenance.computed_tokens == len(ids) - num_chunks * CHUNK
        assert remote_stats(cb)["promoted_pages"] == num_chunks
        assert engine_b.stats().checksum_failures == 0
        cold, provenance = run(engine_b, ids, cold_options)
        assert provenance.computed_tokens == len(ids)
        assert reused == cold
        engine_b.close()
