#!/usr/bin/env python3
"""A hybrid model's state checkpoint interval M (--state-checkpoint-chunks): bytes stored against prefill recomputed.

Per M, a built-in engine with a pool (no local cache, no reuse in place: every resume comes from the pool, as on a
fresh replica) prefills a prompt of ``--tokens`` tokens cold and stores it (KV pages, and its state every M chunks
and at the prompt's end); then prompts that share a prefix of d tokens with it and go on differently (d spread
over the prompt: a shared document, another question) resume at the deepest checkpoint their prefix reaches and
compute the rest. Rows: the bytes stored (KV, states), the shared tokens computed again, the resumed prefill's
time, and the stored prompt's cold prefill for scale::

    PYTHONPATH=$PWD python benchmarks/state_checkpoints.py --model qwen3.5-tiny --tokens 8192 --every 2,4,8,16,32
    python3 benchmarks/state_checkpoints.py --model qwen3.5-27b --device cuda --tokens 131072 --every 16,32,64 \\
        --shares 0.29,0.55,0.83 --pool-size 32GiB --json $OUT/state_checkpoints.json   # GPU: ~5 min, H100
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def measure(args, socket: str, rng) -> list[dict]:
    """Per interval: a fresh prompt stored cold, then resumes at each shared prefix through the pool."""
    import dataclasses

    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, SamplingParams

    # one engine in both roles (two 27B replicas do not fit one GPU): no local cache and no reuse in place, so every
    # resume comes from the pool as on a fresh replica; one set of weights for every interval
    config = EngineConfig(
        model=args.model,
        device=args.device,
        pool_socket=socket,
        chunk_tokens=args.chunk_tokens,
        local_cache_bytes=0,
        reuse_in_place=False,
        max_model_len=args.tokens + args.tail + 8,
    )
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine = Engine(config)
    rows = []
    try:
        vocab = min(engine.model_config.vocab_size, 256 if engine.model_config.vocab_size < 1000 else 150000)
        for every in args.every:
            engine.hybrid.config = dataclasses.replace(config, state_checkpoint_chunks=every)
            before = engine.stats()
            prompt = rng.integers(0, vocab, args.tokens).tolist()  # fresh: nothing of it in the pool yet
            list(engine.generate(prompt, params))
            stored = _difference(engine.stats(), before)
            # longest shared prefix first: the checkpoints a resumed prompt stores (its own end) then lie past every
            # later, shorter one's, which finds only the stored prompt's
            for share in sorted(args.shares, reverse=True):
                shared = int(share * args.tokens)
                ids = prompt[:shared] + rng.integers(0, vocab, args.tail).tolist()
                rows.append(_resume_row(engine, ids, shared, every, stored, params))
    finally:
        engine.close()
    return rows


def _difference(after, before) -> dict:
    names = ("pool_bytes_stored", "pool_state_bytes_stored", "pool_states_stored", "prefill_seconds")
    return {name: getattr(after, name) - getattr(before, name) for name in names}


def _resume_row(engine, ids: list[int], shared: int, every: int, stored, params) -> dict:
    before = engine.stats().prefill_seconds
    events = list(engine.generate(ids, params))
    provenance = events[0].provenance
    reused = provenance.local_tokens + provenance.pool_tokens
    return {
        "every": every,
        "shared_tokens": shared,
        "prompt_tokens": len(ids),
        "kv_bytes_stored": stored["pool_bytes_stored"],
        "state_bytes_stored": stored["pool_state_bytes_stored"],
        "checkpoints_stored": stored["pool_states_stored"],
        "cold_s": stored["prefill_seconds"],  # the stored prompt's cold prefill, for scale
        "reused_tokens": reused,
        "recomputed_shared_tokens": shared - reused,  # the shared prefix past the deepest checkpoint
        "state_bytes_loaded": provenance.pool_state_bytes,
        "resumed_s": engine.stats().prefill_seconds - before,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=8192, help="the stored prompt")
    p.add_argument("--tail", type=int, default=64, help="tokens of a resumed prompt's own after the shared prefix")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--every", default="2,4,8,16,32", help="the intervals M to measure (chunks)")
    p.add_argument(
        "--shares",
        default="0.13,0.29,0.41,0.55,0.68,0.83",
        help="shared prefix lengths as fractions of the stored prompt",
    )
    p.add_argument(
        "--pool-size", default="4GiB", help="holds one stored prompt and its resumes (the 27B at 128k: 32GiB)"
    )
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args(argv)
    args.shares = [float(x) for x in args.shares.split(",")]
    args.every = [int(x) for x in args.every.split(",")]
    from kvshare.bench.records import describe_host, tree_commit
    from kvshare.pool.spawn import running_pool

    rng = np.random.default_rng(0)
    with running_pool(args.pool_size, ("--extent-size", "1GiB"), quiet=True) as socket:
        rows = measure(args, socket, rng)
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
