"""A request given up between two layers of its prefill (RequestOptions.is_cancelled) leaves nothing behind:
no lease held in the pool, no chunk of its prompt published (local cache or pool), and the engine's next
request gives the same tokens as before."""

from __future__ import annotations

import pytest

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.errors import RequestCancelled
from kvshare.pool.client import PoolClient
from tests.engine.conftest import ascii_prompt

CHUNK = 16
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
COLD = RequestOptions(use_pool=False, use_local_cache=False)


def tokens(engine: Engine, ids, options: RequestOptions = RequestOptions()):
    events = list(engine.generate(ids, PARAMS, options))
    p = events[0].provenance
    return [e.token_id for e in events], (p.local_tokens, p.pool_tokens, p.computed_tokens)


def cancel_at(layer: int):
    """An is_cancelled that answers True from the ``layer``-th question on (asked once before each layer)."""
    asked = []

    def is_cancelled() -> bool:
        asked.append(len(asked))
        return len(asked) > layer

    return is_cancelled, asked


def test_a_prefill_cancelled_between_layers_leaves_no_trace(tiny_dir, pool_socket):
    a = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True))
    b = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True))
    ids = a.tokenizer.encode(ascii_prompt(80, seed=3))
    other = a.tokenizer.encode(ascii_prompt(70, seed=4))
    cold, _ = tokens(a, ids, COLD)
    assert tokens(a, ids)[1] == (0, 0, 80)  # A computed it and stored its chunks in the pool

    # B loads the prefix from the pool, and is cancelled before layer 1 reads it
    is_cancelled, asked = cancel_at(1)
    with pytest.raises(RequestCancelled, match="before layer 1"):
        list(b.generate(ids, PARAMS, RequestOptions(is_cancelled=is_cancelled)))
    assert len(asked) == 2  # asked before layers 0 and 1, and no further
    with PoolClient(pool_socket) as client:
        assert client.list_leases() == []  # the load's lease went back
        assert client.check_integrity() >= 0
    # the same request again on B: from the pool, the cold tokens (B's KV and local cache were not left half made)
    assert tokens(b, ids) == (cold, (0, 64, 16))

    # a cold prefill cancelled at its first layer publishes nothing: neither B's local cache nor the pool has it
    is_cancelled, _ = cancel_at(0)
    with pytest.raises(RequestCancelled, match="before layer 0"):
        list(b.generate(other, PARAMS, RequestOptions(is_cancelled=is_cancelled)))
    other_cold, _ = tokens(a, other, COLD)
    assert tokens(b, other) == (other_cold, (0, 0, 70))  # computed again: nothing of it was kept anywhere
    a.close()
    b.close()


def test_a_check_that_never_says_cancel_changes_nothing(tiny_dir):
    engine = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK))
    ids = engine.tokenizer.encode(ascii_prompt(50, seed=5))
    cold, _ = tokens(engine, ids, COLD)
    asked = []
    out = tokens(engine, ids, RequestOptions(use_local_cache=False, is_cancelled=lambda: asked.append(1) or False))
    assert out == (cold, (0, 0, 50)) and len(asked) == engine.model_config.num_layers
    engine.close()
