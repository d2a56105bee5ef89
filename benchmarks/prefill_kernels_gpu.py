"""Cold prefill of the built-in engine with its fused element-wise kernels (kvshare.engine.fused) against the same
engine and weights with the eager ones, alternating in one process on one GPU.

    PYTHONPATH=. python3 benchmarks/prefill_kernels_gpu.py --preset qwen3-8b --lengths 32768 --out $OUT

Each length: one warm-up prefill per variant, then --repeats rounds of (fused, eager) in alternating order; a
prefill is an engine request of max_tokens 1 with the pool and the local cache off (always cold), timed to its
token. Also per length: whether both variants pick the same first token, and their top logprobs. Prints one JSON
row per length and writes them to OUT/prefill_kernels.json. ``KVSHARE_BENCH_DEVICE=cpu`` runs the logic on CPU
(the fused kernels are refused there: the rows say so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

DEVICE = os.environ.get("KVSHARE_BENCH_DEVICE", "cuda")


def _prefill(engine, ids: list[int]) -> tuple[float, int, float]:
    import torch

    from kvshare.engine.sampler import SamplingParams

    if DEVICE != "cpu":
        torch.cuda.synchronize()
    started = time.perf_counter()
    event = next(iter(engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True, logprobs=1))))
    return time.perf_counter() - started, event.token_id, event.logprob


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention", default="auto", help="the engine's --attention (auto: FlashAttention 3 if found)")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch

    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.engine.fused import set_fused

    os.makedirs(a.out, exist_ok=True)
    engine = Engine(
        EngineConfig(
            model=a.preset,
            device=DEVICE,
            dtype="bfloat16",
            attention=a.attention,
            local_cache_bytes=0,
            max_model_len=max(a.lengths) + 64,
        )
    )
    kernels = engine.fused.kernels
    hardware = torch.cuda.get_device_name() if DEVICE != "cpu" else "cpu"
    rows = []
    for n in a.lengths:
        g = torch.Generator().manual_seed(n)
        variants = {"fused": kernels, "eager": None} if kernels is not None else {"eager": None}
        times: dict[str, list[float]] = {name: [] for name in variants}
        first: dict[str, tuple[int, float]] = {}
        for round_index in range(a.repeats + 1):  # round 0 warms up (kernel compiles, allocator)
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for name in order:
                set_fused(engine.model, variants[name])
                ids = torch.randint(4, 250, (n,), generator=g).tolist() if round_index else None
                seconds, token, logprob = _prefill(engine, ids or [5 + (i * 7919) % 240 for i in range(n)])
                if round_index:
                    times[name].append(seconds)
                else:
                    first[name] = (token, logprob)
        set_fused(engine.model, kernels)
        row = {
            "preset": a.preset,
            "prompt_tokens": n,
            "hardware": hardware,
            "attention": engine.attention.name,
            "fused": kernels.name if kernels is not None else None,
            "fused_reason": engine.fused.reason,
            "eager_s": statistics.median(times["eager"]),
            "eager_all_s": times["eager"],
            "first_token_eager": first["eager"],
            "commit": os.environ.get("KVSHARE_COMMIT", ""),
        }
        if kernels is not None:
            row.update(
                fused_s=statistics.median(times["fused"]),
                fused_all_s=times["fused"],
                fused_over_eager=statistics.median(times["fused"]) / statistics.median(times["eager"]),
                first_token_fused=first["fused"],
                first_token_equal=first["fused"][0] == first["eager"][0],
            )
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(os.path.join(a.out, "prefill_kernels.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
