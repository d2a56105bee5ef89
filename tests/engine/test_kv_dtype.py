"""--kv-dtype: the sequence KV (and the pool's pages) in another dtype than the model's; fp8 halves bf16's bytes.

The dtype is part of the namespace, so replicas of two KV dtypes never read each other's pages; fp8 pages
move through the pool bit for bit, and a pool-loaded fp8 run gives what recomputing with fp8 KV gives.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.config import EngineConfig, kv_storage_dtype
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.engine.model import attend, write_kv
from kvshare.keys import chunk_keys, namespace_digest
from kvshare.pool.client import PoolClient
from tests.engine.conftest import ascii_prompt
from tests.engine.test_reuse import COLD, run

CHUNK = 16
NO_LOCAL = RequestOptions(use_local_cache=False)


def engine(model: str, kv_dtype: str, pool: str | None = None, **kw) -> Engine:
    return Engine(
        EngineConfig(
            model=model,
            chunk_tokens=CHUNK,
            pool_socket=pool,
            verify_checksums=pool is not None,
            kv_dtype=kv_dtype,
            **kw,
        )
    )


def test_kv_dtype_choices_and_bytes_per_token(tiny_dir):
    assert kv_storage_dtype("auto", "bfloat16") == "bfloat16" and kv_storage_dtype("fp8", "bfloat16") == "float8_e4m3fn"
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(model=tiny_dir, kv_dtype="int4")
    f32, bf16, fp8 = (engine(tiny_dir, d) for d in ("auto", "bf16", "fp8"))
    assert (f32.layout.dtype, bf16.layout.dtype, fp8.layout.dtype) == ("float32", "bfloat16", "float8_e4m3fn")
    assert bf16.layout.bytes_per_token == 2 * fp8.layout.bytes_per_token  # fp8 halves bf16
    assert f32.layout.bytes_per_token == 4 * fp8.layout.bytes_per_token
    assert fp8._kv.ensure(CHUNK).dtype == torch.float8_e4m3fn
    digests = {namespace_digest(e.namespace) for e in (f32, bf16, fp8)}
    assert len(digests) == 3 and fp8.namespace.kv_precision == "e4m3 scale 1.0"
    assert bf16.namespace.kv_precision == "native"


def test_fp8_cache_saturates_and_attention_upcasts():
    kv = torch.zeros(2, 1, 4, 2, dtype=torch.float8_e4m3fn)  # [2, H, T, D]
    k = torch.tensor([[[1000.0, -1000.0]], [[0.5, 3.0]]])  # [n, H, D]
    write_kv(kv, 1, k, -k)
    assert kv[0, 0, 1].float().tolist() == [448.0, -448.0] and kv[1, 0, 1].float().tolist() == [-448.0, 448.0]
    assert kv[0, 0, 2].float().tolist() == [0.5, 3.0]
    q = torch.randn(2, 1, 2)  # [Hq, T, D]
    out = attend(q, kv[0, :, :4], kv[1, :, :4], 3)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_replicas_of_two_kv_dtypes_never_load_each_others_pages(tiny_dir, pool_socket):
    ids = engine(tiny_dir, "auto").tokenizer.encode(ascii_prompt(75, seed=21))
    reused = 64
    bf16_writer = engine(tiny_dir, "bf16", pool_socket)
    run(bf16_writer, ids, NO_LOCAL)  # computes and stores bf16 pages
    fp8_writer = engine(tiny_dir, "fp8", pool_socket)
    assert run(fp8_writer, ids, NO_LOCAL)[1] == (0, 0, 75)  # the bf16 pages are not its: computed
    assert fp8_writer.stats().pool_hit_chunks == 0
    fp8_reader, bf16_reader = engine(tiny_dir, "fp8", pool_socket), engine(tiny_dir, "bf16", pool_socket)
    assert run(fp8_reader, ids, NO_LOCAL)[1] == (0, reused, 11)
    assert run(bf16_reader, ids, NO_LOCAL)[1] == (0, reused, 11)
    assert fp8_reader.stats().pool_bytes_loaded == reused // CHUNK * fp8_reader.layout.page_bytes
    assert bf16_reader.stats().pool_bytes_loaded == 2 * fp8_reader.stats().pool_bytes_loaded
    with PoolClient(pool_socket) as client:  # each dtype's chain holds pages of its own size only
        for e in (fp8_reader, bf16_reader):
            keys = chunk_keys(namespace_digest(e.namespace), ids, CHUNK)
            pages = client.lookup(keys, e.layout.page_bytes, lease=False).pages
            assert len(pages) == 4 and {p.page_bytes for p in pages} == {e.layout.page_bytes}


def test_fp8_pages_round_trip_and_pool_reuse_equals_fp8_recompute(tiny_dir, pool_socket):
    a, b = engine(tiny_dir, "fp8", pool_socket), engine(tiny_dir, "fp8", pool_socket)
    ids = a.tokenizer.encode(ascii_prompt(75, seed=22))
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    cold = list(a.generate(ids, params, COLD))
    keys = chunk_keys(namespace_digest(a.namespace), ids, CHUNK)
    run(a, ids, RequestOptions(use_pool=False))  # computed; kept in a's local cache only
    run(a, ids, NO_LOCAL)  # ... and stored in the pool (it lacked them)
    pooled = list(b.generate(ids, params))
    p = pooled[0].provenance
    assert (p.local_tokens, p.pool_tokens, p.computed_tokens) == (0, 64, 11)
    stored, loaded = a._local.longest_prefix(keys), b._local.longest_prefix(keys)
    assert len(stored) == len(loaded) == 4
    with PoolClient(pool_socket) as client:
        pages = client.lookup(keys, a.layout.page_bytes, lease=False).pages
        for s, l, page in zip(stored, loaded, pages):
            assert s.dtype == torch.float8_e4m3fn and torch.equal(s.view(torch.uint8), l.view(torch.uint8))
            raw = torch.from_numpy(client.page(page.offset, page.page_bytes).copy())
            assert torch.equal(raw.view(a.layout.page_shape), s.view(torch.uint8).transpose(2, 3))
    stats_a, stats_b = a.stats(), b.stats()
    assert stats_b.pool_bytes_loaded == stats_a.pool_bytes_stored == 4 * a.layout.page_bytes
    assert [e.token_id for e in pooled] == [e.token_id for e in cold]  # == recomputing with fp8 KV
    local = list(a.generate(ids, params, RequestOptions(use_pool=False)))  # the same bytes, from a's local cache
    assert [(e.token_id, e.logprob) for e in pooled] == [(e.token_id, e.logprob) for e in local]
