#!/usr/bin/env python3
"""A hybrid model's state checkpoint interval M (--state-checkpoint-chunks): bytes stored against prefill recomputed.

Two built-in engines share one pool in this process. Per M: replica A prefills a prompt of ``--tokens`` tokens cold
and stores it (KV pages, and its state every M chunks and at the prompt's end); replica B then sends prompts that
share a prefix of d tokens with it and go on differently (d spread over the prompt, off every chunk boundary: a
shared document, another question). B resumes at the deepest checkpoint its prefix reaches and computes the rest.
Rows: the bytes A stored (KV, states), the tokens B computed beyond its shared prefix, B's prefill time, and B's
cold prefill of the same prompt for scale::

    PYTHONPATH=$PWD python benchmarks/state_checkpoints.py --model qwen3.5-tiny --tokens 8192 --every 2,4,8,16,32
    python3 benchmarks/state_checkpoints.py --model qwen3.5-27b --device cuda --tokens 131072 --every 16,32,64 \\
        --json $OUT/state_checkpoints.json                                     # on the GPU (one 27B replica pair)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def measure(args, every: int, socket: str, rng) -> list[dict]:
    """One interval: A's store, then B's resumes at each shared prefix (and B's cold prefill of each prompt)."""
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, RequestOptions, SamplingParams

    config = EngineConfig(
        model=args.model,
        device=args.device,
        pool_socket=socket,
        chunk_tokens=args.chunk_tokens,
        state_checkpoint_chunks=every,
        local_cache_bytes=0,
        max_model_len=args.tokens + 2 * args.tail + 8,
    )
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    a, b = Engine(config), Engine(config)
    try:
        vocab = min(a.model_config.vocab_size, 256 if a.model_config.vocab_size < 1000 else 150000)
        prompt = rng.integers(0, vocab, args.tokens).tolist()
        list(a.generate(prompt, params))
        stored = a.stats()
        rows = []
        for share in args.shares:
            d = int(share * args.tokens) // args.chunk_tokens * args.chunk_tokens + args.chunk_tokens // 2
            ids = prompt[:d] + rng.integers(0, vocab, args.tail).tolist()
            rows.append(_resume_row(b, ids, d, every, stored, params, RequestOptions))
        return rows
    finally:
        a.close()
        b.close()


def _resume_row(b, ids: list[int], shared: int, every: int, stored, params, options) -> dict:
    before = b.stats().prefill_seconds
    start = time.perf_counter()
    events = list(b.generate(ids, params, options(use_local_cache=False)))
    resumed_s = time.perf_counter() - start
    start = time.perf_counter()
    list(b.generate(ids, params, options(use_pool=False, use_local_cache=False)))
    cold_s = time.perf_counter() - start
    provenance = events[0].provenance
    reused = provenance.local_tokens + provenance.pool_tokens
    return {
        "every": every,
        "shared_tokens": shared,
        "prompt_tokens": len(ids),
        "kv_bytes_stored": stored.pool_bytes_stored,
        "state_bytes_stored": stored.pool_state_bytes_stored,
        "checkpoints_stored": stored.pool_states_stored,
        "reused_tokens": reused,
        "recomputed_shared_tokens": shared - reused,  # the shared prefix past the deepest checkpoint
        "state_bytes_loaded": provenance.pool_state_bytes,
        "resumed_s": resumed_s,
        "cold_s": cold_s,
        "prefill_s_engine": b.stats().prefill_seconds - before,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=8192, help="A's prompt")
    p.add_argument("--tail", type=int, default=64, help="tokens of B's own after the shared prefix")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--every", default="2,4,8,16,32", help="the intervals M to measure (chunks)")
    p.add_argument("--shares", default="0.3,0.55,0.8", help="shared prefix lengths as fractions of A's prompt")
    p.add_argument("--pool-size", default="4GiB")
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args(argv)
    args.shares = [float(x) for x in args.shares.split(",")]
    from kvshare.bench.records import describe_host, tree_commit
    from kvshare.pool.spawn import running_pool

    rng = np.random.default_rng(0)
    rows = []
    for every in (int(x) for x in args.every.split(",")):
        with running_pool(args.pool_size, ("--extent-size", "1GiB"), quiet=True) as socket:
            rows += measure(args, every, socket, rng)
    command = " ".join(["python3", "benchmarks/state_checkpoints.py", *(sys.argv[1:] if argv is None else argv)])
    for row in rows:
        row |= {
            "model": args.model,
            "commit": tree_commit(),
            "hardware": describe_host(args.device),
            "command": command,
        }
    print("| M | shared | KV stored MiB | states stored MiB | checkpoints | recomputed | resumed s | cold s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['every']} | {r['shared_tokens']} | {r['kv_bytes_stored'] / 2**20:.1f} | "
            f"{r['state_bytes_stored'] / 2**20:.1f} | {r['checkpoints_stored']} | {r['recomputed_shared_tokens']} | "
            f"{r['resumed_s']:.3f} | {r['cold_s']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
