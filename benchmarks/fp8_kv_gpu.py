"""fp8 KV against bf16 KV in the built-in engine: cross-replica TTFT, and what fp8 costs in quality.

    PYTHONPATH=. python3 benchmarks/fp8_kv_gpu.py --out $OUT [--cases 8b:32768,8b:131072,32b:32768] [--budget-s 290]
    PYTHONPATH=. python3 benchmarks/fp8_kv_gpu.py --out /tmp/fp8 --device cpu --model tiny --tokens 1024   # dry run

Per case, for bf16 KV and then fp8 KV (``EngineConfig.kv_dtype``), against a pool daemon of its own:
  A (``--role quality``, this script): a cold prefill that stores the prompt's pages. bf16: its 64 greedy tokens.
    Both dtypes: the 64 next-token distributions along bf16's greedy continuation, teacher forced (one forward
    over the prompt's last token and bf16's first 63 tokens), so both are read at the same positions.
  B (engine_ttft_gpu.py's B role, reused as is): a fresh process loads the prefix from the pool: cross-replica
    TTFT (median of three), the suffix's compute, one contiguous pinned copy of the same bytes; the bound is
    max(loaded bytes / that copy's bandwidth, suffix compute).
Quality, against bf16 KV: ``top1_agreement`` is the share of the 64 positions where fp8's argmax is bf16's;
``max/mean_logprob_delta`` are |logprob_fp8 - logprob_bf16| of bf16's top-1 token. Weights are the presets'
synthetic ones. Writes ``OUT/fp8_kv.json``: one row per case and KV dtype.

On an H200 (both dtypes of a case, estimated from the engine TTFT runs): 8b:131072 ~200 s, 32b:32768 ~140 s,
32b:131072 ~370 s (bf16's B holds 65.5 GB of weights, 34 GB of KV and a 34 GB copy of the loaded bytes:
~134 GB of 149). --budget-s only stops cases from starting, so split them over commands of ~590 s:
    --cases 8b:131072,32b:32768 --budget-s 420      then      --cases 32b:131072 --budget-s 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NUM_TOKENS = 64  # greedy tokens compared
KV_BYTES_PER_TOKEN_BF16 = {"8b": 36 * 2 * 8 * 128 * 2, "32b": 64 * 2 * 8 * 128 * 2, "tiny": 8 * 2 * 2 * 64 * 2}


def fit_prompt(preset_name: str, n: int) -> int:
    """The prompt within the preset's positions, with a chunk of room for the engines' tokens (32B at 131072:
    130816; the engines' max_model_len is the prompt + 128 and may not pass the model's 131072 positions)."""
    from kvshare.engine.presets import PRESETS as SHAPES

    preset = SHAPES.get(preset_name)
    return n if preset is None else min(n, preset.config.max_position_embeddings - 256)


def quality(args) -> dict:
    """Role A: cold prefill (stores the pages), the 64 teacher-forced distributions; bf16 also greedy tokens."""
    import torch

    sys.path.insert(0, HERE)
    import engine_ttft_gpu as ttft  # its DEVICE comes from KVSHARE_BENCH_DEVICE, set by main()

    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, RequestOptions, SamplingParams

    n = args.tokens
    ids = ttft.prompt_ids(n)
    engine = Engine(
        EngineConfig(
            model=args.preset,
            device=ttft.DEVICE,
            pool_socket=args.pool,
            local_cache_bytes=0,
            max_model_len=n + 2 * NUM_TOKENS,
            kv_dtype=args.kv_dtype,
        )
    )
    cold_off = RequestOptions(use_pool=False, use_local_cache=False)
    list(engine.generate(ttft.prompt_ids(300), SamplingParams(max_tokens=2, ignore_eos=True), cold_off))  # warm-up
    reference = None
    if args.reference:
        with open(args.reference) as f:
            reference = json.load(f)
    ttft.sync()
    t0 = time.perf_counter()
    stream = engine.generate(ids, SamplingParams(max_tokens=1 if reference else NUM_TOKENS, ignore_eos=True))
    events = [next(stream)]
    ttft.sync()
    cold_s = time.perf_counter() - t0
    events += list(stream)  # the rest of bf16's greedy tokens; the prompt's pages are stored after the first
    tokens = reference["tokens"] if reference else [e.token_id for e in events]
    kv = engine._kv.ensure(n + NUM_TOKENS)  # holds the prompt's KV (and bf16's continuation, rewritten alike)
    forced = torch.tensor([ids[-1]] + tokens[: NUM_TOKENS - 1], device=ttft.DEVICE)
    with torch.inference_mode():
        logprobs = torch.log_softmax(engine.model(forced, kv, n - 1, all_logits=True), dim=-1)  # [64, V]
    top1 = logprobs.argmax(dim=-1).tolist()
    out = {
        "cold_s": cold_s,
        "kv_dtype": engine.layout.dtype,
        "kv_bytes": n * engine.layout.bytes_per_token,
        "tokens": tokens,
        "top1": top1,
    }
    if reference is None:
        out["lp_top1"] = logprobs.gather(1, torch.tensor(top1, device=logprobs.device)[:, None])[:, 0].tolist()
        out.update(top1_agreement=1.0, max_logprob_delta=0.0, mean_logprob_delta=0.0)
    else:
        ref_top1 = torch.tensor(reference["top1"], device=logprobs.device)
        lp = logprobs.gather(1, ref_top1[:, None])[:, 0].cpu()
        deltas = (lp - torch.tensor(reference["lp_top1"])).abs()
        out.update(
            top1_agreement=sum(a == b for a, b in zip(top1, reference["top1"])) / NUM_TOKENS,
            max_logprob_delta=float(deltas.max()),
            mean_logprob_delta=float(deltas.mean()),
        )
    engine.close()
    return out


def _child(cmd: list[str], timeout_s: float) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30.0, timeout_s))
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[1:4])} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_dtype(model: str, preset: str, n: int, kv_dtype: str, reference: str | None, timeout_s: float) -> dict:
    """One row: quality role then cross-replica role, against a fresh pool sized for this dtype's pages."""
    from kvshare.pool.spawn import running_pool

    kv_gib = n * KV_BYTES_PER_TOKEN_BF16[model] / 2**30 * (0.5 if kv_dtype == "fp8" else 1.0)
    with running_pool(f"{int(kv_gib * 1.3) + 2}GiB", ("--extent-size", "256MiB"), quiet=True) as sock:
        started = time.time()
        q = _child(
            [
                sys.executable,
                __file__,
                "--role",
                "quality",
                "--preset",
                preset,
                "--tokens",
                str(n),
                "--pool",
                sock,
                "--kv-dtype",
                kv_dtype,
            ]
            + (["--reference", reference] if reference else []),
            timeout_s,
        )
        b = _child(
            [
                sys.executable,
                os.path.join(HERE, "engine_ttft_gpu.py"),
                "--role",
                "B",
                "--preset",
                preset,
                "--tokens",
                str(n),
                "--pool",
                sock,
                "--local-cache-bytes",
                "0",
                "--kv-dtype",
                kv_dtype,
            ],
            timeout_s - (time.time() - started),
        )
    cross = b["cross"]
    bound = max(cross["pool_bytes"] / (b["contiguous_h2d_gbps"] * 1e9), b["suffix_compute_s"])
    row = {
        "model": preset,
        "prompt_tokens": n,
        "kv_dtype": q["kv_dtype"],
        "cross_s": cross["ttft_s"],
        "bound_s": bound,
        "cross_over_bound": cross["ttft_s"] / bound,
        "kv_bytes": q["kv_bytes"],
        "top1_agreement": q["top1_agreement"],
        "max_logprob_delta": q["max_logprob_delta"],
        "mean_logprob_delta": q["mean_logprob_delta"],
        "cold_s": q["cold_s"],
        "cross_first_s": b["cross_first"]["ttft_s"],
        "cross_runs_s": b["cross_runs_s"],
        "pool_tokens": cross["pool"],
        "pool_bytes": cross["pool_bytes"],
        "pool_load_s": cross["pool_load_s"],
        "suffix_compute_s": b["suffix_compute_s"],
        "contiguous_h2d_gbps": b["contiguous_h2d_gbps"],
    }
    return row, q


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--cases", default="8b:32768,8b:131072,32b:32768", help="model:tokens,... (models: 8b, 32b, tiny)")
    p.add_argument("--model", default=None, help="with --tokens: one case (e.g. --model tiny --tokens 1024)")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the logic")
    p.add_argument(
        "--budget-s", type=float, default=290.0, help="cases not started within this many seconds are skipped"
    )
    p.add_argument("--role", choices=("quality",))
    p.add_argument("--preset")
    p.add_argument("--pool")
    p.add_argument("--kv-dtype", default="bf16")
    p.add_argument("--reference", default=None, help="quality role: the bf16 run's JSON (tokens, top1, lp_top1)")
    args = p.parse_args()
    if args.role:
        print(json.dumps(quality(args)), flush=True)
        return 0
    os.environ["KVSHARE_BENCH_DEVICE"] = args.device  # read by both roles' processes
    sys.path.insert(0, HERE)
    from engine_ttft_gpu import PRESETS

    cases = (
        [(args.model, args.tokens)]
        if args.model
        else [(m, int(t)) for m, t in (c.split(":") for c in args.cases.split(","))]
    )
    cases = [(m, fit_prompt(PRESETS.get(m, m), n)) for m, n in cases]
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for model, n in cases:
            bf16 = None
            for kv_dtype in ("bf16", "fp8"):
                left = args.budget_s - (time.time() - t0)
                if left <= 0:
                    rows.append(
                        {"model": PRESETS[model], "prompt_tokens": n, "kv_dtype": kv_dtype, "skipped": "time budget"}
                    )
                    continue
                reference = os.path.join(tmp, f"{model}_{n}_bf16.json") if kv_dtype == "fp8" else None
                try:
                    row, q = run_dtype(model, PRESETS[model], n, kv_dtype, reference, min(540.0, left + 120.0))
                except Exception as exc:  # noqa: BLE001 - recorded in the row; the other cases still run
                    rows.append(
                        {
                            "model": PRESETS[model],
                            "prompt_tokens": n,
                            "kv_dtype": kv_dtype,
                            "error": f"{type(exc).__name__}: {exc}",
                        }
                    )
                    print(f"{model}:{n} {kv_dtype} FAILED: {exc}", flush=True)
                    break  # fp8 needs bf16's reference
                if kv_dtype == "bf16":
                    bf16 = row
                    with open(os.path.join(tmp, f"{model}_{n}_bf16.json"), "w") as f:
                        json.dump({k: q[k] for k in ("tokens", "top1", "lp_top1")}, f)
                row["cross_speedup_vs_bf16"] = bf16["cross_s"] / row["cross_s"]
                rows.append(row)
                print(
                    f"{row['model']:10s} {n:7d} tok  kv {row['kv_dtype']:13s} cross {row['cross_s']:.3f}s "
                    f"bound {row['bound_s']:.3f}s ({row['cross_over_bound']:.2f}x)  "
                    f"vs bf16 {row['cross_speedup_vs_bf16']:.2f}x  "
                    f"kv {row['kv_bytes'] / 2**30:.2f} GiB  top1 {row['top1_agreement']:.3f}  "
                    f"dlogprob max {row['max_logprob_delta']:.4f} mean {row['mean_logprob_delta']:.4f}",
                    flush=True,
                )
                with open(os.path.join(args.out, "fp8_kv.json"), "w") as f:
                    json.dump({"device": args.device, "num_tokens_compared": NUM_TOKENS, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "fp8_kv.json"), "w") as f:
        json.dump(
            {"device": args.device, "num_tokens_compared": NUM_TOKENS, "wall_s": time.time() - t0, "rows": rows},
            f,
            indent=1,
        )
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
