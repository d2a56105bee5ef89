"""The engine on CUDA: logits against CPU, reuse equality through CudaTransfer, the producer-delay check.

Skipped without CUDA. Run on the GPU machine with ``python -m pytest -q -m gpu tests/engine``.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from tests.engine.conftest import ascii_prompt
from tests.engine.test_reuse import COLD, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CHUNK = 16
NO_LOCAL = RequestOptions(use_local_cache=False)


def test_cuda_logits_match_cpu():
    cpu = Engine(EngineConfig(model="tiny"))
    gpu = Engine(EngineConfig(model="tiny", device="cuda"))
    ids = torch.tensor(cpu.tokenizer.encode(ascii_prompt(300, seed=3)))
    with torch.inference_mode():
        expected = cpu.model(ids, torch.zeros(8, 2, 2, 320, 64), 0, all_logits=True)
        kv = torch.zeros(8, 2, 2, 320, 64, device="cuda")
        got = gpu.model(ids.cuda(), kv, 0, all_logits=True).cpu()
        kv2 = torch.zeros_like(kv)
        gpu.model(ids[:200].cuda(), kv2, 0)
        suffix = gpu.model(ids[200:].cuda(), kv2, 200, all_logits=True).cpu()
    assert (got - expected).abs().max().item() < 1e-3
    assert (suffix - expected[200:]).abs().max().item() < 1e-3
    with torch.inference_mode():  # the last token only: the last layer attends for one query (flash, no mask)
        kv3 = torch.zeros_like(kv)
        gpu.model(ids[:200].cuda(), kv3, 0)
        last = gpu.model(ids[200:].cuda(), kv3, 200).cpu()
    assert (last[0] - expected[-1]).abs().max().item() < 1e-3
    assert torch.equal(kv3.cpu(), kv2.cpu())  # every suffix token's K/V written, the last layer's too


def test_cuda_reuse_equals_cold(pool_socket):
    def engine(**kw) -> Engine:
        return Engine(
            EngineConfig(
                model="tiny", device="cuda", chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True, **kw
            )
        )

    a, b, c = engine(reuse_in_place=False), engine(), engine()  # a: the local cache's whole chunks
    for n in (64, 75):
        ids = a.tokenizer.encode(ascii_prompt(n, seed=n))
        cold, _ = run(a, ids, COLD)
        r = (n - 1) // CHUNK * CHUNK
        assert run(a, ids) == (cold, (0, 0, n))
        assert run(a, ids) == (cold, (r, 0, n - r))
        assert run(b, ids, NO_LOCAL) == (cold, (0, r, n - r))
        assert run(c, ids) == (cold, (0, r, n - r))  # from the pool; c keeps the sequence it computed on
        assert run(c, ids) == (cold, (n - 1, 0, 1))  # reused in place, to the token: the last token alone computed
    assert b.stats().checksum_failures == 0


def test_store_waits_for_a_delayed_producer(pool_socket):
    """A long GPU sleep before prefill writes the KV: the stored pages must still hold that KV."""
    writer = Engine(
        EngineConfig(
            model="tiny",
            device="cuda",
            chunk_tokens=CHUNK,
            pool_socket=pool_socket,
            verify_checksums=True,
            producer_delay_cycles=200_000_000,
        )
    )
    reader = Engine(
        EngineConfig(model="tiny", device="cuda", chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True)
    )
    ids = writer.tokenizer.encode(ascii_prompt(200, seed=9))
    cold, _ = run(writer, ids, COLD)
    assert run(writer, ids, NO_LOCAL) == (cold, (0, 0, 200))
    assert run(reader, ids, NO_LOCAL) == (cold, (0, 192, 8))


# bf16: reuse and recompute agree up to rounding. Measured on the H200 (qwen3-8b/32b presets, 4k-32k):
# |d logprob| of the top token between a cold prefill and a suffix over reused KV had a median of
# 0.01-0.03 and a maximum of 0.17, so outputs must be identical up to the first step whose top-2
# logprob gap is below this bound.
BF16_GAP = 0.5


def _first_divergence(cold, other) -> tuple[int | None, float | None]:
    for step, (c, o) in enumerate(zip(cold, other)):
        if c.token_id != o.token_id:
            best = sorted(c.top_logprobs.values())
            return step, best[-1] - best[-2]
    return None, None


def test_qwen3_8b_shape_builds_fast_and_reuses_through_the_pool():
    """The Qwen3-8B shape in bf16, built on the device; local and cross-engine pool reuse agree with cold."""
    import time

    from kvshare.pool.spawn import running_pool

    started = time.perf_counter()
    # max_model_len: two 8B engines live at once below, each would preallocate 36 GiB of KV at the preset's 262144
    a = Engine(EngineConfig(model="qwen3-8b", device="cuda", local_cache_bytes=4 << 30, max_model_len=16384))
    assert time.perf_counter() - started < 60
    n = 8192
    ids = [int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0))]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    cold = list(a.generate(ids, params, COLD))
    with running_pool("4GiB", ("--extent-size", "256MiB"), quiet=True) as sock:
        a = Engine(
            EngineConfig(
                model="qwen3-8b",
                device="cuda",
                local_cache_bytes=4 << 30,
                pool_socket=sock,
                verify_checksums=True,
                max_model_len=16384,
                reuse_in_place=False,  # the second request takes the local cache's whole chunks (in place: n - 1)
            )
        )
        computed = list(a.generate(ids, params))
        local = list(a.generate(ids, params))
        b = Engine(
            EngineConfig(
                model="qwen3-8b",
                device="cuda",
                local_cache_bytes=0,
                pool_socket=sock,
                verify_checksums=True,
                max_model_len=16384,
            )
        )
        pooled = list(b.generate(ids, params))
    p = [(e[0].provenance.local_tokens, e[0].provenance.pool_tokens) for e in (computed, local, pooled)]
    assert p == [(0, 0), (n - 256, 0), (0, n - 256)]
    for events in (computed, local, pooled):
        step, gap = _first_divergence(cold, events)
        assert step is None or gap < BF16_GAP, f"diverged at step {step} where the top-2 gap was {gap:.4f}"


def test_pool_load_gives_exactly_what_local_reuse_gives():
    """The overlapped pool load, in every enqueue mode, against local reuse of the same KV bytes (bf16, 8B shape).

    A local-cache hit and a pool load put identical bytes before the same suffix computation, so token ids
    and logprobs must be bitwise equal (unlike a recompute, whose chunking changes bf16 rounding). A load
    whose copies the compute stream did not wait for layer by layer would show here.
    """
    import dataclasses

    from kvshare.pool.spawn import running_pool
    from kvshare.transfer.base import LOAD_ENQUEUE_MODES

    n = 16384
    ids = [int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    with running_pool("8GiB", ("--extent-size", "256MiB"), quiet=True) as sock:
        a = Engine(
            EngineConfig(
                model="qwen3-8b",
                device="cuda",
                local_cache_bytes=3 << 30,
                pool_socket=sock,
                verify_checksums=True,
                max_model_len=32768,
                reuse_in_place=False,  # the local cache's whole chunks: the same suffix as the pool load computes
            )
        )
        list(a.generate(ids, params))  # computes, stores in the pool and the local cache
        local = list(a.generate(ids, params))
        a.close()
        b = Engine(
            EngineConfig(
                model="qwen3-8b",
                device="cuda",
                local_cache_bytes=0,
                pool_socket=sock,
                verify_checksums=True,
                max_model_len=32768,
                reuse_in_place=False,  # every enqueue mode's request loads from the pool
            )
        )
        reused = n - 256
        assert (local[0].provenance.local_tokens, local[0].provenance.pool_tokens) == (reused, 0)
        transfer = b._pool.transfer
        for mode in LOAD_ENQUEUE_MODES:
            transfer.config = dataclasses.replace(transfer.config, load_enqueue=mode)
            pooled = list(b.generate(ids, params))
            assert (pooled[0].provenance.local_tokens, pooled[0].provenance.pool_tokens) == (0, reused), mode
            got = [(e.token_id, e.logprob, e.top_logprobs) for e in pooled]
            assert got == [(e.token_id, e.logprob, e.top_logprobs) for e in local], mode
        assert b.stats().checksum_failures == 0
        b.close()


def test_decode_step_is_deterministic():
    """The same decode step on the same KV, repeated, gives the same bits (bf16, 8B shape, 16k of context).

    With cuDNN first for one-query attention this gave two different results in 30 repeats on the H200
    (logits up to 0.1 apart), which made two identical requests part at some generated step.
    """
    n = 16384
    ids = [int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(2))]
    engine = Engine(EngineConfig(model="qwen3-8b", device="cuda", local_cache_bytes=0))
    first = list(engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True)))
    kv = engine._kv.ensure(n + 1)
    saved = kv[:, :, :, :n].clone()
    results = set()
    for _ in range(30):
        kv[:, :, :, :n].copy_(saved)
        logits = engine._decode_step(kv, first[0].token_id, n)
        results.add(logits.cpu().numpy().tobytes() + kv[:, :, :, n].float().cpu().numpy().tobytes())
    engine.close()
    assert len(results) == 1, f"{len(results)} different results from 30 identical decode steps"


def test_gpu_store_commits_wsum32_and_load_checks_it_beside_the_copies(pool_socket):
    """GPU store -> GPU load moves the bytes exactly, with WSUM32 summed on the GPU both ways; a page spoiled
    after commit is caught by the check beside the copies, dropped, and computed again from there."""
    from kvshare.keys import chunk_keys, namespace_digest
    from kvshare.pool.checksum import ChecksumKind, page_checksum
    from kvshare.pool.client import PoolClient
    from kvshare.transfer.layouts import as_bits

    def engine(kv_dtype: str = "auto") -> Engine:
        return Engine(
            EngineConfig(
                model="tiny",
                device="cuda",
                chunk_tokens=CHUNK,
                pool_socket=pool_socket,
                verify_checksums=True,
                kv_dtype=kv_dtype,
            )
        )

    for kv_dtype in ("auto", "fp8"):
        writer, reader = engine(kv_dtype), engine(kv_dtype)
        ids = writer.tokenizer.encode(ascii_prompt(80, seed=41 + len(kv_dtype)))
        cold, _ = run(writer, ids, COLD)
        run(writer, ids, RequestOptions(use_pool=False))  # computed, kept in the writer's local cache
        run(writer, ids, NO_LOCAL)  # ... and stored in the pool
        keys = chunk_keys(namespace_digest(writer.namespace), ids, CHUNK)
        assert run(reader, ids) == (cold, (0, 64, 16))
        loaded = reader._local.longest_prefix(keys)[:4]  # the reader's chunks 0..3 came from the pool
        with PoolClient(pool_socket) as client:
            pages = client.lookup(keys, writer.layout.page_bytes, lease=False).pages
            assert len(pages) == 5 and {p.checksum_kind for p in pages} == {ChecksumKind.WSUM32}
            for page in pages:  # the GPU's sums are the host's over the committed bytes
                assert page.checksum == page_checksum(client.page(page.offset, page.page_bytes), ChecksumKind.WSUM32)
            assert len(loaded) == 4
            # bytes loaded == bytes stored: engine [L,2,H,C,D] -> page [L,2,C,H,D]
            for page, chunk in zip(pages, loaded):
                held = as_bits(chunk).transpose(2, 3).contiguous().cpu().numpy().tobytes()
                assert held == bytes(client.page(page.offset, page.page_bytes))
            client.page(pages[2].offset, pages[2].page_bytes)[5] ^= 0x40  # chunk 2 goes bad in the pool
        checker = engine(kv_dtype)
        assert run(checker, ids, NO_LOCAL) == (cold, (0, 32, 48))
        assert (checker.stats().checksum_failures, checker.stats().dropped_chunks) == (1, 1)
        for e in (writer, reader, checker):
            e.close()


def test_fp8_kv_on_gpu_halves_the_bytes_and_reuse_equals_recompute(pool_socket):
    """The tiny model (float32) with fp8 KV on CUDA: a pool load gives the greedy tokens of an fp8 recompute."""
    fp8 = Engine(
        EngineConfig(
            model="tiny",
            device="cuda",
            chunk_tokens=CHUNK,
            pool_socket=pool_socket,
            verify_checksums=True,
            kv_dtype="fp8",
        )
    )
    bf16 = Engine(EngineConfig(model="tiny", device="cuda", chunk_tokens=CHUNK, kv_dtype="bf16"))
    assert bf16.layout.bytes_per_token == 2 * fp8.layout.bytes_per_token
    reader = Engine(
        EngineConfig(
            model="tiny",
            device="cuda",
            chunk_tokens=CHUNK,
            pool_socket=pool_socket,
            verify_checksums=True,
            kv_dtype="fp8",
        )
    )
    ids = fp8.tokenizer.encode(ascii_prompt(200, seed=43))
    cold, _ = run(fp8, ids, COLD)
    assert run(fp8, ids, NO_LOCAL) == (cold, (0, 0, 200))
    assert run(reader, ids, NO_LOCAL) == (cold, (0, 192, 8))
    assert reader.stats().pool_bytes_loaded == 12 * fp8.layout.page_bytes
    for e in (fp8, bf16, reader):
        e.close()


def test_bf16_head_logits_in_float32_without_an_upcast_copy():
    """The CUDA logits of a bf16 head (torch.mm to float32) equal the upcast head's to float32 rounding."""
    from types import SimpleNamespace

    from kvshare.engine import model as M

    torch.manual_seed(0)
    head = torch.nn.Linear(256, 40000, bias=False).to("cuda", torch.bfloat16)
    h = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(3, 40000, device="cuda", dtype=torch.float32)
    M.Transformer.logits(SimpleNamespace(lm_head=head), h, out)
    assert M._mm_to_float32(torch.device("cuda"), torch.bfloat16), "torch.mm(out_dtype=float32) is not available"
    reference = h.double() @ head.weight.double().t()  # the exact products' sums
    upcast = h.float() @ head.weight.float().t()  # what the engine computed before
    assert (out.double() - reference).abs().max().item() <= 4 * (upcast.double() - reference).abs().max().item() + 1e-5
    assert torch.equal(out.argmax(-1), upcast.argmax(-1))


def test_greedy_step_on_the_gpu_equals_the_cpu_path():
    from kvshare.engine.sampler import _greedy_where_logits_are, _with_logprobs

    for seed in range(4):
        row = (torch.randn(151936, generator=torch.Generator().manual_seed(seed)) * 3).to(torch.bfloat16)
        got = _greedy_where_logits_are(row.cuda(), 5)
        raw = row.float()
        want = _with_logprobs(raw, int(torch.argmax(raw)), 5)
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        # bf16 rows hold ties: their order may differ
        same_order = list(got.top_logprobs) == list(want.top_logprobs)
        assert same_order or sorted(got.top_logprobs.values()) == pytest.approx(
            sorted(want.top_logprobs.values()), abs=1e-5
        )
        assert _greedy_where_logits_are(row.cuda(), None).token_id == want.token_id


def test_the_same_prompt_again_runs_its_last_token_through_the_decode_graphs():
    """In place, one token left: a decode step's graphs compute it (an eager one-token forward is launch-bound),
    with the cold run's tokens (float32); the decode graphs' capture beside it leaves the held tokens alone."""
    engine = Engine(EngineConfig(model="tiny", device="cuda", chunk_tokens=CHUNK, dtype="float32"))
    ids = engine.tokenizer.encode(ascii_prompt(300, seed=7))
    cold, _ = run(engine, ids, COLD)
    calls = []
    step = engine._decode_step
    engine._decode_step = lambda kv, token_id, position: calls.append(position) or step(kv, token_id, position)
    assert run(engine, ids) == (cold, (0, 0, 300))
    first = list(calls)
    assert run(engine, ids) == (cold, (299, 0, 1))
    assert calls[len(first)] == 299  # the prompt's last token, at its position, through the graphs
    engine.close()
