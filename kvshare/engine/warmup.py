"""A replica's warm-up: the one-time costs of the request path, paid before it reports healthy.

Without it the first request of a fresh replica pays them inside its TTFT (on the H200 a
replica's first cross-replica load took ~0.4 s more than its later ones). Already done by
the engine's constructor: the sequence KV is allocated (CUDA), the pool's arena is mapped and
registered with CUDA, the transfer's streams and staging buffers exist. The warm-up runs
the rest through the real path, in a private namespace nothing a user sends can name::

    1. store   a cold prefill of WARMUP_CHUNKS + 1 chunks, stored to the pool after its first
               token (the gather kernels, device->host copies, checksums, reserve and commit)
    2. load    the same prompt again: lookup and lease, the load's copies and scatter kernels
               overlapped with a suffix of one full chunk, page verification, the first decode
    3. load    a prompt of WARMUP_CHUNKS chunks and half a chunk: a partial-chunk suffix
    4. drop    the warm-up's chunks leave the pool again
    5. suffix kernels (CUDA)  forwards of suffixes of SUFFIX_LENGTHS tokens over cached prefixes of
               SUFFIX_PREFIXES tokens, with no pool: CUDA loads a kernel on its first launch, and the
               attention and GEMM kernels a forward picks depend on its shape (flash's split-KV
               variant at long keys, uneven lengths, small-M GEMMs). On the H200 a replica's first
               load at 30999 tokens (a 23-token suffix) computed its first layer 71 ms late; its
               first at 32768 ended its forward 5.7 ms later than the next one did.

Its requests are left out of the engine's counters (``Engine.uncounted``), so /metrics
shows only what users asked for. Where no pool is connected only the prefills run.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

WARMUP_CHUNKS = 2  # chunks the warm-up's loads reuse: two pages cover a run of consecutive pages
SUFFIX_PREFIXES = (4096, 4153)  # cached tokens: even and uneven key lengths, long enough for split-KV attention
SUFFIX_LENGTHS = (1, 23, 100, 256)  # a decode step; short, uneven and one-chunk suffixes
WARMUP_SEED = 20261201


@dataclass
class WarmupReport:
    """What the warm-up did (kept by the server; /health shows it)."""

    seconds: float = 0.0
    pool_chunks_stored: int = 0  # chunks of the warm-up's prompts the pool took
    pool_chunks_loaded: int = 0  # chunks the warm-up's requests loaded from the pool
    step_seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "seconds": round(self.seconds, 4),
            "pool_chunks_stored": self.pool_chunks_stored,
            "pool_chunks_loaded": self.pool_chunks_loaded,
            "step_seconds": {k: round(v, 4) for k, v in self.step_seconds.items()},
        }


def warmup_prompts(chunk_tokens: int, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """The warm-up's prompts: (WARMUP_CHUNKS + 1) full chunks, then WARMUP_CHUNKS and a half (pure).

    A prompt of k full chunks reuses k - 1 of them (one token is always computed), so the
    first runs a suffix of one whole chunk, the second one of half a chunk. Both start with
    the same WARMUP_CHUNKS chunks, so the second finds them in the pool too. Shortened (fewer
    chunks) where the model's context is smaller.
    """
    num_chunks = WARMUP_CHUNKS
    while num_chunks > 0 and (num_chunks + 1) * chunk_tokens + 2 >= max_model_len:
        num_chunks -= 1
    rng = np.random.default_rng(WARMUP_SEED)
    length = max(1, num_chunks + 1) * chunk_tokens if num_chunks else min(chunk_tokens, max_model_len - 3)
    ids = rng.integers(0, vocab_size, size=length).tolist()
    return [ids, ids[: num_chunks * chunk_tokens + chunk_tokens // 2]] if num_chunks else [ids]


def warm_up(engine: Any) -> WarmupReport:
    """Run the warm-up on ``engine`` (before any request); returns what it did."""
    from kvshare.engine.engine import RequestOptions, SamplingParams

    started = time.perf_counter()
    report = WarmupReport()
    tenant = f"kvshare-warmup-{secrets.token_hex(8)}"  # a namespace of its own: no user request shares a chunk
    options = RequestOptions(use_pool=True, use_local_cache=False, tenant=tenant)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # two tokens: one decode step
    prompts = warmup_prompts(engine.layout.chunk_tokens, engine.model_config.vocab_size, engine.max_model_len)
    steps = [("store", prompts[0]), ("load", prompts[0])] + [("load_partial", p) for p in prompts[1:]]
    keys: set[bytes] = set()
    with engine.uncounted():
        for name, prompt in steps:
            t0 = time.perf_counter()
            before = engine.stats()
            events = list(engine.generate(prompt, params, options))  # both tokens: the decode step runs too
            report.pool_chunks_loaded += events[0].provenance.pool_tokens // engine.layout.chunk_tokens
            report.pool_chunks_stored += engine.stats().pool_stored_chunks - before.pool_stored_chunks
            keys.update(engine.prompt_chunk_keys(prompt, tenant))
            report.step_seconds[name] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.drop_chunks(sorted(keys))
        report.step_seconds["drop"] = time.perf_counter() - t0
    if engine.device.type == "cuda":
        t0 = time.perf_counter()
        warm_suffix_kernels(engine)
        report.step_seconds["suffix_kernels"] = time.perf_counter() - t0
    report.seconds = time.perf_counter() - started
    log.info("warm-up done in %.3f s: %s", report.seconds, report.as_dict())
    return report


def warm_suffix_kernels(
    engine: Any, prefixes: tuple[int, ...] = SUFFIX_PREFIXES, lengths: tuple[int, ...] = SUFFIX_LENGTHS
) -> int:
    """Forwards of each suffix length over each cached prefix in the engine's KV (nothing is stored or
    reused; the KV is scratch until the next request writes it). Returns how many ran; prefixes that
    do not fit max_model_len are left out."""
    import torch

    fitting = [p for p in prefixes if p + max(lengths) < engine.max_model_len]
    if not fitting:
        return 0
    generator = torch.Generator().manual_seed(WARMUP_SEED)
    ids = torch.randint(0, engine.model_config.vocab_size, (max(fitting) + max(lengths),), generator=generator)
    ids = ids.to(engine.device)
    chunk = engine.config.prefill_chunk_tokens
    ran = 0
    state = getattr(engine.model, "state", None)  # a hybrid's GDN state: each suffix resumes its prefix's
    with engine._lock, torch.inference_mode():
        kv = engine._kv.ensure(len(ids))
        if state is None:
            engine.model(ids[: max(fitting)], kv, 0, chunk)  # the prefixes' KV (a cold prefill)
        else:
            at = {p: state.empty_checkpoint(p) for p in fitting}
            engine.model(ids[: max(fitting)], kv, 0, chunk, checkpoints=at)
        for prefix in fitting:
            for n in lengths:
                if state is not None:
                    state.restore(at[prefix])
                engine.model(ids[prefix : prefix + n], kv, prefix, chunk)
                ran += 1
        if state is not None:
            state.reset()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    return ran
