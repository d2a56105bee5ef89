"""Engine-level TTFT on the H200: cold, local reuse, cross-replica reuse through the pool.

    PYTHONPATH=. python3 benchmarks/engine_ttft_gpu.py --out $OUT [--cases 8b:8k,8b:32k,32b:128k]

Each case (preset, prompt tokens) runs two engine processes one after the other
against one pool daemon, as two replicas would:
  A: cold prefill (pool on, so it stores the prompt's chunks), then the same prompt
     again (local reuse, when the local cache can hold it next to the model);
  B: a fresh process, empty local cache: the same prompt loads its prefix from the
     pool (cross-replica reuse). In the same process: one contiguous pinned -> GPU
     copy of the same number of KV bytes (the reference bandwidth), and the suffix's
     own compute time (a forward over the tail after the prefix is in place).
Also in the run: the bf16 matmul rate (8192^3), against which the cold prefill's
FLOP rate is given. Targets: pool -> GPU load >= 0.9 of the contiguous copy;
cross TTFT <= 1.15 x max(KV bytes / copy bandwidth, suffix compute); cold prefill
>= 60% of the matmul rate at 32k (8B) and 128k (32B).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PRESETS = {"8b": "qwen3-8b", "32b": "qwen3-32b", "tiny": "tiny"}
DEVICE = os.environ.get("KVSHARE_BENCH_DEVICE", "cuda")  # "cpu" for a dry run of this script's logic


def sync() -> None:
    import torch

    if DEVICE != "cpu":
        torch.cuda.synchronize()


def parse_tokens(text: str) -> int:
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def prompt_ids(n: int) -> list[int]:
    import torch

    return [int(t) for t in torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(n))]


def flops_prefill(cfg, n: int) -> float:
    """Matmul FLOPs of a cold prefill of n tokens (projections, MLP, causal attention, LM head of 1 token)."""
    h, L = cfg.hidden_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * L * (h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size)
    return per_token * n + flops_attention(cfg, n) + 2 * h * cfg.vocab_size


def flops_attention(cfg, n: int) -> float:
    """The attention's share of ``flops_prefill``: QK^T and PV over the causal half."""
    return 2 * cfg.num_layers * 2 * n * n * cfg.num_heads * cfg.head_dim / 2


class Timeline:
    """Where a cross-replica request's time goes: host marks, and GPU events against the load's start.

    Bench-only instrumentation (wraps the engine's pool link and hooks the model's forward)."""

    def __init__(self, engine) -> None:
        import torch

        self.marks: dict[str, float] = {}
        self.events: dict[str, object] = {}
        self.handle = None
        self.t0 = 0.0
        link, model = engine._pool, engine.model
        load_prefix = link.load_prefix

        def timed_load(*args, **kwargs):
            self.marks["lookup_start"] = time.perf_counter()
            load = load_prefix(*args, **kwargs)
            self.marks["load_returned"] = time.perf_counter()
            self.handle = load.handle
            return load

        link.load_prefix = timed_load
        gpu = DEVICE != "cpu"

        def pre(module, args):
            self.marks["forward_start"] = time.perf_counter()
            if gpu:
                self.events["forward_start"] = torch.cuda.Event(enable_timing=True)
                self.events["forward_start"].record()

        def post(module, args, out):
            self.marks["forward_enqueued"] = time.perf_counter()
            if gpu:
                self.events["forward_end"] = torch.cuda.Event(enable_timing=True)
                self.events["forward_end"].record()

        model.register_forward_pre_hook(pre)
        model.register_forward_hook(post)

    def reset(self) -> None:
        self.marks, self.events, self.handle = {}, {}, None
        self.t0 = time.perf_counter()

    def summary(self) -> dict:
        out = {f"host_{k}_ms": round((v - self.t0) * 1e3, 2) for k, v in self.marks.items()}
        h = self.handle
        if DEVICE != "cpu" and h is not None and hasattr(h, "start"):
            for name, event in self.events.items():
                out[f"gpu_{name}_ms"] = round(h.start.elapsed_time(event), 2)
            out["gpu_load_end_ms"] = round(h.start.elapsed_time(h.end), 2)
        return out


def role(args) -> dict:
    import dataclasses

    import torch

    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, RequestOptions, SamplingParams

    n = args.tokens
    ids = prompt_ids(n)
    engine = Engine(
        EngineConfig(
            model=args.preset,
            device=DEVICE,
            pool_socket=args.pool,
            local_cache_bytes=args.local_cache_bytes,
            max_model_len=n + 64,
            verify_fraction=args.verify_fraction,
            kv_dtype=getattr(args, "kv_dtype", "auto"),
        )
    )
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    out: dict = {"role": args.role, "kv_bytes": n * engine.layout.bytes_per_token}
    timeline = None

    def ttft(options=RequestOptions(), prompt=ids):
        sync()
        before = engine.stats()
        if timeline is not None:
            timeline.reset()
        t0 = time.perf_counter()
        stream = engine.generate(prompt, params, options)
        event = next(stream)
        sync()
        dt = time.perf_counter() - t0
        # closed only now: closing the stream publishes the prompt's chunks (local cache, pool store), which a
        # server does after streaming the first token; closed before sync() it was timed as part of the TTFT
        stream.close()
        after = engine.stats()
        p = event.provenance
        result = {
            "ttft_s": dt,
            "local": p.local_tokens,
            "pool": p.pool_tokens,
            "computed": p.computed_tokens,
            "pool_bytes": after.pool_bytes_loaded - before.pool_bytes_loaded,
            "pool_load_s": after.pool_load_seconds - before.pool_load_seconds,
            "store_s": after.pool_store_seconds - before.pool_store_seconds,
        }
        if timeline is not None:
            result["timeline"] = timeline.summary()
        return result

    warm = prompt_ids(300)[:300]
    list(engine.generate(warm, params, RequestOptions(use_pool=False, use_local_cache=False)))  # CUDA warm-up
    if args.role == "A":
        size = 8192 if DEVICE != "cpu" else 512
        a = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
        a @ a
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ a
        sync()
        out["matmul_tflops"] = 10 * 2 * size**3 / (time.perf_counter() - t0) / 1e12
        del a
        flops = flops_prefill(engine.model_config, n)
        if n <= 64 * 1024:  # a first cold prefill of this length (another prompt) pays one-time costs (kernel plans)
            first = ttft(RequestOptions(use_pool=False, use_local_cache=False), prompt=[t ^ 1 for t in ids])
            out["cold_first"] = {**first, "tflops": flops / first["ttft_s"] / 1e12}
        cold = ttft()
        cold["tflops"] = flops / cold["ttft_s"] / 1e12
        out["cold"] = cold
        time.sleep(1.0)  # the store of the prompt's chunks finishes after the first token
        list(engine.generate(warm, params, RequestOptions(use_pool=False, use_local_cache=False)))
        out["local"] = ttft() if args.local_cache_bytes else None
    else:
        transfer = engine._pool.transfer
        if transfer is not None and args.enqueue:
            transfer.config = dataclasses.replace(transfer.config, load_enqueue=args.enqueue)
        out["load_enqueue"] = transfer.config.load_enqueue if transfer is not None else None
        timeline = Timeline(engine)
        # B's local cache is off: each request loads the whole prefix from the pool; the first one in this
        # process also pays one-time costs (kernel plans for the suffix's shape), the second one does not
        out["cross_first"] = ttft()
        runs = sorted((ttft() for _ in range(3)), key=lambda r: r["ttft_s"])
        out["cross"] = runs[1]  # the median of three
        out["cross_runs_s"] = [r["ttft_s"] for r in runs]
        timeline = None
        # the suffix's own compute: the prefix is in place now (local cache off: recompute only the tail)
        tail = n - out["cross"]["pool"] - out["cross"]["local"]
        kv = engine._kv.ensure(n + 1)
        toks = torch.tensor(ids, device=DEVICE)
        with torch.inference_mode():
            engine.model(toks[n - tail :], kv, n - tail)
            sync()
            t0 = time.perf_counter()
            engine.model(toks[n - tail :], kv, n - tail)
            sync()
        out["suffix_compute_s"] = time.perf_counter() - t0
        out["suffix_tokens"] = tail
        nbytes = out["cross"]["pool_bytes"] or out["kv_bytes"]
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE != "cpu")
        host.fill_(1)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
        dev.copy_(host, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync()
        out["contiguous_h2d_s"] = time.perf_counter() - t0
        out["contiguous_h2d_gbps"] = nbytes / out["contiguous_h2d_s"] / 1e9
    engine.close()
    return out


def run_case(model: str, tokens: int, pool_size: str, out_dir: str, local_cache_bytes: int, compare: list[str]) -> dict:
    from kvshare.pool.spawn import running_pool

    preset = PRESETS[model]
    case = {"preset": preset, "tokens": tokens}
    roles = [("A", ""), ("B", "")] + [("B", mode) for mode in compare]
    with running_pool(pool_size, ("--extent-size", "256MiB"), quiet=True) as sock:
        for r, mode in roles:
            cmd = [
                sys.executable,
                __file__,
                "--role",
                r,
                "--preset",
                preset,
                "--tokens",
                str(tokens),
                "--pool",
                sock,
                "--local-cache-bytes",
                str(local_cache_bytes if r == "A" else 0),
                "--enqueue",
                mode,
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
            if proc.returncode:
                case[f"error_{r}{mode}"] = proc.stderr[-3000:]
                return case
            result = {k: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items() if k != "role"}
            if mode:  # a comparison run: the load's copies enqueued another way
                case.setdefault("compare", {})[mode] = {k: result[k] for k in ("cross_first", "cross")}
            else:
                case.update(result)
    cross = case["cross"]
    case["load_gbps"] = cross["pool_bytes"] / cross["pool_load_s"] / 1e9 if cross["pool_load_s"] else None
    case["load_ratio_vs_contiguous"] = (case["load_gbps"] / case["contiguous_h2d_gbps"]) if case["load_gbps"] else None
    bound = max(cross["pool_bytes"] / (case["contiguous_h2d_gbps"] * 1e9), case["suffix_compute_s"])
    case["bound_s"] = bound
    case["cross_over_bound"] = cross["ttft_s"] / bound
    case["cross_first_over_bound"] = case["cross_first"]["ttft_s"] / bound
    for other in case.get("compare", {}).values():
        other["cross_over_bound"] = other["cross"]["ttft_s"] / bound
    case["cold_pct_of_matmul"] = 100 * case["cold"]["tflops"] / case["matmul_tflops"]
    if "cold_first" in case:
        case["cold_first_pct_of_matmul"] = 100 * case["cold_first"]["tflops"] / case["matmul_tflops"]
    return case


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--cases", default="8b:8k,8b:32k,8b:64k,32b:32k,32b:128k")
    p.add_argument("--role", choices=("A", "B"))
    p.add_argument("--preset")
    p.add_argument("--tokens", type=int)
    p.add_argument("--pool")
    p.add_argument("--local-cache-bytes", type=int, default=0)
    p.add_argument("--verify-fraction", type=float, default=0.0)
    p.add_argument("--kv-dtype", default="auto", help="the engines' KV dtype (EngineConfig.kv_dtype)")
    p.add_argument("--enqueue", default="", help="B: TransferConfig.load_enqueue (default: the config's default)")
    p.add_argument("--compare-enqueue", default="", help="comma list of other load_enqueue modes to run B with too")
    args = p.parse_args()
    if args.role:
        print(json.dumps(role(args)), flush=True)
        return 0
    os.makedirs(args.out, exist_ok=True)
    results = []
    for spec in args.cases.split(","):
        model, tokens = spec.split(":")
        n = parse_tokens(tokens)
        kv_gib = n * {"32b": 64 * 2 * 8 * 128 * 2, "8b": 36 * 2 * 8 * 128 * 2, "tiny": 8192}[model] / 2**30
        pool = f"{int(kv_gib * 1.3) + 4}GiB"
        local = int(kv_gib * 1.1 * 2**30) if not (model == "32b" and n > 64 * 1024) else 0  # 32B at 128k: no room
        t0 = time.time()
        case = run_case(model, n, pool, args.out, local, [m for m in args.compare_enqueue.split(",") if m])
        case["wall_s"] = time.time() - t0
        results.append(case)
        with open(os.path.join(args.out, "engine_ttft_gpu.json"), "w") as f:
            json.dump(results, f, indent=1)
        if "cross" in case:
            c = case
            local = c["local"]["ttft_s"] if c.get("local") else float("nan")
            first = (
                f" (first {c['cold_first']['ttft_s']:.3f}s {c['cold_first_pct_of_matmul']:.0f}%)"
                if "cold_first" in c
                else ""
            )
            print(
                f"{c['preset']:10s} {n:7d} tok  cold {c['cold']['ttft_s']:7.3f}s ({c['cold_pct_of_matmul']:4.0f}% of "
                f"{c['matmul_tflops']:.0f} TF){first}  local {local:6.3f}s  cross {c['cross']['ttft_s']:6.3f}s "
                f"(first {c['cross_first']['ttft_s']:.3f}s) pool_tok {c['cross']['pool']}  "
                f"load {c['load_gbps'] or 0:5.1f} GB/s "
                f"= {c['load_ratio_vs_contiguous'] or 0:.2f}x contig {c['contiguous_h2d_gbps']:.1f}  "
                f"suffix {c['suffix_compute_s']:.3f}s  bound {c['bound_s']:.3f}s  "
                f"cross/bound {c['cross_over_bound']:.2f}",
                flush=True,
            )
            print(f"    timeline (ms): {c['cross'].get('timeline')}", flush=True)
            print(f"    load enqueued: {c.get('load_enqueue')}", flush=True)
            for mode, w in c.get("compare", {}).items():
                print(
                    f"    load enqueued {mode}: cross {w['cross']['ttft_s']:.3f}s "
                    f"(first {w['cross_first']['ttft_s']:.3f}s) "
                    f"cross/bound {w['cross_over_bound']:.2f}; timeline (ms): {w['cross'].get('timeline')}",
                    flush=True,
                )
        else:
            errors = "".join(v[-800:] for k, v in case.items() if k.startswith("error_"))
            print(f"{model}:{tokens} FAILED: {errors}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
