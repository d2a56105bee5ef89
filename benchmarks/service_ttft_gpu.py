#!/usr/bin/env python3
"""Cross-replica TTFT through the service, as a user measures it, against the physical bound.

Per case (model shape, prompt length) a fresh cluster: ``kvshare up --replicas 2 --policy round_robin``
(``together``), or, where two replicas do not fit the GPU (the 32B shape), a pool, a router and one
``kvshare serve`` at a time (``sequential``: A, then B in its place). Then, per path (``router``: through
the router; ``replica``: to the replicas' own ports), two fresh random token-id prompts, each sent
three times, streamed, max_tokens 16, temperature 0, the timeline asked for::

    A cold  ->  B cross-replica (through the pool)  ->  A local hit        (TTFT = first streamed token)

B's first request of the cluster is ``first_request``; the second prompt is the steady state. The bound
is the bytes the cross request loaded from the pool (KV pages, and for a hybrid model the state checkpoint:
``kv_bytes``, ``state_bytes``, from its kvshare object) over the pinned host->device bandwidth measured in
this run (a torch copy of 1 GiB; 55e9 B/s, flagged, when that fails). Replicas verify every loaded page (the
default). Rows go to OUT/service_ttft.json (a rerun skips the cases it holds); a line per case, a table at the
end. Each row names its commit, the machine and the command.

    export PYTHONPATH=.:/tmp/site
    python3 benchmarks/service_ttft_gpu.py --out $OUT --cases 8b:32768,8b:131072,8b:262144
    python3 benchmarks/service_ttft_gpu.py --out $OUT --cases 27b:131072 --paths replica    # the Qwen3.5 hybrid
    python3 benchmarks/service_ttft_gpu.py --out /tmp/st --device cpu --cases tiny:1024    # the CPU dry run
    python3 benchmarks/service_ttft_gpu.py --out /tmp/st --device cpu --cases tiny35:1024 --layout sequential
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # up_cluster beside this script

from up_cluster import Cluster, ClusterSpec  # noqa: E402

MODELS = {
    "8b": "qwen3-8b",
    "32b": "qwen3-32b",
    "tiny": "tiny",
    "27b": "qwen3.5-27b",  # the Qwen3.5 hybrid (Gated DeltaNet + gated attention): the study's model class
    "9b": "qwen3.5-9b",
    "tiny35": "qwen3.5-tiny",
}
GiB = 1 << 30
FALLBACK_H2D = 55e9  # B/s: pinned H2D on the H200 in earlier runs
# cold prefill seconds = a*n + b*n^2, fitted to the H200 figures (8B: 1.87 s at 32k, 13.3 s at 131k; 32B: 6 s, 48 s);
# the 27B hybrid's to its H100 figures (4.1 s at 32k, 20.6 s at 131k: docs/results/2026-12-07-efd2ed6-h100-hybrid-
# tail-graphs); the 9B hybrid's a guess until measured (2.5 s, 13 s)
COLD_FIT = {
    "qwen3-8b": (4.19e-5, 4.58e-10),
    "qwen3-32b": (1.17e-4, 2.01e-9),
    "tiny": (2e-4, 2e-8),
    "qwen3.5-27b": (1.14e-4, 3.32e-10),
    "qwen3.5-9b": (6.87e-5, 2.33e-10),
    "qwen3.5-tiny": (2e-4, 2e-8),
}
# one replica's start and warm-up (sequential: x2); a preset's weights are made on the device at start (the 27B
# hybrid's two starts and its cold, local and cross requests took 98-106 s at 32k on an H100)
START_S = {
    "qwen3-8b": 60.0,
    "qwen3-32b": 45.0,
    "tiny": 20.0,
    "qwen3.5-27b": 45.0,
    "qwen3.5-9b": 60.0,
    "qwen3.5-tiny": 20.0,
}


def parse_cases(text: str) -> list[tuple[str, int]]:
    cases = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, tokens = part.partition(":")
        if name not in MODELS or not tokens.isdigit():
            raise argparse.ArgumentTypeError(f"a case is SHAPE:TOKENS with SHAPE in {', '.join(MODELS)}; got {part!r}")
        cases.append((MODELS[name], int(tokens)))
    return cases


def weights_bytes(c) -> int:
    """bf16 bytes of a model's weights: attention (a hybrid's query projection doubled by its gate), its Gated
    DeltaNet layers' projections, MLPs, embedding and head."""
    gate = 2 if c.is_hybrid else 1
    attention = c.hidden_size * c.head_dim * ((1 + gate) * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    total = c.num_kv_layers * attention + c.num_layers * mlp + 2 * c.vocab_size * c.hidden_size
    if c.is_hybrid:
        la = c.linear_attention
        conv_dim = 2 * la.num_key_heads * la.key_head_dim + la.num_value_heads * la.value_head_dim
        value_dim = la.num_value_heads * la.value_head_dim
        total += c.num_linear_layers * c.hidden_size * (conv_dim + 2 * value_dim + 2 * la.num_value_heads)
    return 2 * total


def state_bytes_of(c) -> int:
    """A hybrid's state checkpoint (kvshare.state_layout); 0 for an attention model."""
    from kvshare.engine.hybrid_config import state_layout_of

    return state_layout_of(c).checkpoint_bytes if c.is_hybrid else 0


def plan_case(model: str, tokens: int, args, gpu_bytes: int) -> dict:
    """Prompt length, context, cache sizes and layout of one case (pure, from the model's shape)."""
    from kvshare.engine.presets import PRESETS

    c = PRESETS[model].config
    chunk = 256
    prompt = min(tokens, c.max_position_embeddings - args.max_tokens)
    context = -(-(prompt + args.max_tokens) // chunk) * chunk
    kv_token = c.kv_bytes_per_token
    kv = prompt * kv_token
    weights, kv_context = weights_bytes(c), context * kv_token
    activations = prompt * (4 * c.hidden_size + 3 * c.num_heads * c.head_dim) * 2 + 2 * GiB
    local = args.local_cache_size if args.local_cache_size is not None else int(kv * 1.05) + chunk * kv_token
    budget = int(gpu_bytes * 0.92)
    checkpoints = 8 * state_bytes_of(c)  # a hybrid's: two per prompt (its end and the chunk before), and room
    plan = {
        "model": model,
        "prompt_tokens": prompt,
        "context": context,
        "kv_bytes": kv,
        "pool_size": (args.pool_size or int(2.2 * kv) + checkpoints + 2 * GiB) // (2 << 20) * (2 << 20),
    }  # whole 2 MiB pages (--hugepages)
    if args.device == "cpu":
        return {**plan, "layout": args.layout if args.layout != "auto" else "together", "local_cache": local}
    for layout, replicas in (("together", 2), ("sequential", 1)):
        if args.layout not in ("auto", layout):
            continue
        for local_bytes in (local, 0):
            if replicas * (weights + kv_context + local_bytes) + activations <= budget:
                return {**plan, "layout": layout, "local_cache": local_bytes}
    return {**plan, "layout": None, "local_cache": 0}


def estimate_s(plan: dict, num_paths: int) -> float:
    a, b = COLD_FIT.get(plan["model"], COLD_FIT["tiny"])
    n = plan["prompt_tokens"]
    starts = (2 if plan["layout"] == "sequential" else 1) * START_S.get(plan["model"], 30.0)
    return starts + num_paths * 2 * (a * n + b * n * n + 8.0) + 20.0


def measure_h2d(device: str) -> tuple[float, bool, int]:
    """(bytes/s of a pinned 1 GiB host->device copy, measured?, GPU bytes), in a child so its memory goes; on CPU
    the rate of a 256 MiB host copy (what a CPU replica's load is bound by)."""
    if device == "cpu":
        return host_copy_rate(), True, 0
    code = (
        "import torch, json\n"
        "n = 1 << 30\nh = torch.empty(n, dtype=torch.uint8).pin_memory()\n"
        "d = torch.empty(n, dtype=torch.uint8, device='cuda')\n"
        "best = 0.0\nfor _ in range(5):\n"
        "    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)\n"
        "    s.record(); d.copy_(h, non_blocking=True); e.record(); e.synchronize()\n"
        "    best = max(best, n / (s.elapsed_time(e) / 1e3))\n"
        "print(json.dumps([best, torch.cuda.mem_get_info()[1]]))\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        rate, total = json.loads(out.stdout.strip().splitlines()[-1])
        return float(rate), True, int(total)
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        print(f"the pinned copy failed ({exc}); the bound uses {FALLBACK_H2D:.3g} B/s", flush=True)
        return FALLBACK_H2D, False, 139 * GiB


def host_copy_rate(num_bytes: int = 256 << 20) -> float:
    """Bytes/s of the best of five host copies of ``num_bytes`` (torch, the copy a CPU replica's load makes)."""
    import torch

    src, dst = torch.ones(num_bytes, dtype=torch.uint8), torch.empty(num_bytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def cluster_spec(plan: dict, args) -> ClusterSpec:
    """The cluster of one case (up_cluster.py): the plan's layout, pool and replica arguments."""
    return ClusterSpec(
        layout=plan["layout"],
        model=plan["model"],
        device=args.device,
        pool_size=str(plan["pool_size"]),
        replica_args=(
            f"--local-cache-size={plan['local_cache']}",
            f"--max-model-len={plan['context']}",
            f"--verify-rate={args.verify_rate}",
            *args.replica_arg,
        ),
        pool_args=tuple(args.pool_arg),
        start_timeout_s=args.start_timeout,
        log_dir=args.log_dir,
    )


async def send(url: str, model: str, ids: list[int], max_tokens: int):
    import aiohttp

    from kvshare.bench.client import BenchRequest
    from kvshare.bench.client import send as bench_send

    async with aiohttp.ClientSession() as session:
        return await bench_send(
            session,
            BenchRequest(url=url, kind="completion", model=model, prompt=ids, max_tokens=max_tokens, timeline=True),
        )


def request(url: str, plan: dict, ids: list[int], args):
    r = asyncio.run(send(url, plan["model"], ids, args.max_tokens))
    if r.error:
        raise RuntimeError(f"a request to {url} failed: {r.error}")
    return r


def run_case(plan: dict, args, h2d: tuple[float, bool], rng) -> list[dict]:
    """Both paths' rows of one case."""
    cluster = Cluster(cluster_spec(plan, args))
    rows: list[dict] = []
    try:
        cluster.start()
        prompts = {
            (path, k): rng.integers(0, args.vocab, plan["prompt_tokens"]).tolist()
            for path in args.paths
            for k in range(2)
        }
        done: dict[tuple, dict] = {}
        cluster.phase("A")
        for (path, k), ids in prompts.items():  # A: cold, then (together: after B) local
            url = cluster.router if path == "router" else cluster.urls["A"]
            done[path, k] = {"cold": request(url, plan, ids, args)}
            if plan["layout"] == "sequential":
                done[path, k]["local"] = request(url, plan, ids, args)
            else:
                b = cluster.router if path == "router" else cluster.urls["B"]
                done[path, k]["cross"] = request(b, plan, ids, args)
                done[path, k]["local"] = request(url, plan, ids, args)
                if path == "router":  # a spacer: round robin puts the next prompt's cold request on A again
                    request(cluster.router, plan, ids[:16], args)
        if plan["layout"] == "sequential":
            cluster.phase("B")
            for (path, k), ids in prompts.items():
                url = cluster.router if path == "router" else cluster.urls["B"]
                done[path, k]["cross"] = request(url, plan, ids, args)
        order = sorted(done, key=lambda key: (args.paths.index(key[0]), key[1]))
        page = arena_page_bytes(cluster.pool_socket)
        for i, key in enumerate(order):
            rows.append({**make_row(plan, key[0], i == 0, done[key], h2d, args), "arena_page_bytes": page})
    finally:
        cluster.stop()
    return rows


def arena_page_bytes(socket_path: str | None) -> int | None:
    """The OS page size under the pool's arena (2 MiB when --hugepages auto found enough reserved), from its stats."""
    from kvshare.pool.client import PoolClient

    try:
        with PoolClient(socket_path, name="service-ttft").connect() as client:
            return client.stats().get("arena_page_bytes")
    except Exception as exc:  # a row without it is still a row
        print(f"pool stats not read: {exc}", flush=True)
        return None


def make_row(plan: dict, path: str, is_first: bool, got: dict, h2d: tuple[float, bool], args) -> dict:
    cold, cross, local = got["cold"], got["cross"], got["local"]
    prov = cross.provenance or {}
    from kvshare.bench.records import describe_host, tree_commit
    from kvshare.engine.presets import PRESETS

    kv = prov.get("pool_kv_bytes")  # what the replica says it loaded; else from the tokens (an older replica)
    kv = prov.get("pool_tokens", 0) * PRESETS[plan["model"]].config.kv_bytes_per_token if kv is None else kv
    state = prov.get("pool_state_bytes", 0)  # a hybrid's state checkpoint, loaded beside the KV
    moved = kv + state
    bound = moved / h2d[0] if moved else None
    local_ok = (local.provenance or {}).get("local_tokens", 0) > 0
    return {
        "model": plan["model"],
        "prompt_tokens": plan["prompt_tokens"],
        "path": path,
        "first_request": is_first,
        "layout": plan["layout"],
        "cold_s": cold.ttft_s,
        "cross_s": cross.ttft_s,
        "local_s": local.ttft_s if local_ok else None,
        "bound_s": bound,
        "cross_over_bound": cross.ttft_s / bound if bound else None,
        "kv_bytes": kv,
        "state_bytes": state,
        "checkpoints_loaded": int(state > 0),
        "commit": tree_commit(),
        "hardware": describe_host(args.device),
        "command": args.command,
        "pool_tokens": prov.get("pool_tokens"),
        "computed_tokens": prov.get("computed_tokens"),
        "cross_replica": prov.get("replica"),
        "cold_replica": (cold.provenance or {}).get("replica"),
        "verified": args.verify_rate >= 1.0 and moved > 0,
        "tokens_equal": cross.token_ids == cold.token_ids,
        "h2d_bytes_per_s": h2d[0],
        "h2d_measured": h2d[1],
        "local_cache_bytes": plan["local_cache"],
        "pool_args": list(args.pool_arg),
        "replica_args": list(args.replica_arg),
        "timeline": prov.get("timeline"),
        "local_timeline": (local.provenance or {}).get("timeline"),
        **output_check(cold, cross),
    }


def output_check(cold, cross) -> dict:
    """B's tokens against A's by the outputs rule of kvshare (a first difference where A's top-2 logprobs were
    within the gap threshold is a near tie of bf16 rounding, not a wrong load), with the step and gap."""
    from kvshare.outputs import check_outputs

    check = check_outputs(
        cold.token_ids, cross.token_ids, cold.top_logprobs or None, output_top_logprobs=cross.top_logprobs or None
    )
    if check is None:
        return {"output_verdict": None, "divergence_step": None, "first_divergence": None, "top2_gap": None}
    step = check.step
    return {"output_verdict": check.verdict, "divergence_step": step, "first_divergence": step, "top2_gap": check.gap}


def fmt(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def line(r: dict) -> str:
    return (
        f"{r['model']} {r['prompt_tokens']:>7} {r['path']:<7} {'first ' if r['first_request'] else 'steady'} "
        f"cold {fmt(r['cold_s'])} cross {fmt(r['cross_s'])} local {fmt(r['local_s'])} bound {fmt(r['bound_s'])} "
        f"x{fmt(r['cross_over_bound'], '.2f')} verified={r['verified']} tokens_equal={r['tokens_equal']} "
        f"outputs={r.get('output_verdict')} (step {r.get('divergence_step')}, gap {fmt(r.get('top2_gap'), '.3g')})"
    )


def _interrupt(*_) -> None:
    raise KeyboardInterrupt()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder of service_ttft.json and the logs")
    p.add_argument(
        "--cases", type=parse_cases, default=parse_cases("8b:32768,8b:131072,8b:262144,32b:32768,32b:131072")
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--paths",
        type=lambda s: [x for x in s.split(",") if x in ("router", "replica")] or ["router"],
        default=["router", "replica"],
        help="router,replica (the first path gets B's first request)",
    )
    p.add_argument("--layout", choices=("auto", "together", "sequential"), default="auto")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--verify-rate", type=float, default=1.0)
    p.add_argument("--pool-size", type=int, default=None, help="bytes (default 2.2 x a prompt's KV + 2 GiB)")
    p.add_argument("--local-cache-size", type=int, default=None, help="bytes (default: a prompt's KV, where it fits)")
    p.add_argument(
        "--replica-arg",
        action="append",
        default=[],
        help="more replica arguments, e.g. --replica-arg=--staging-buffers=4 (repeatable; rows record them)",
    )
    p.add_argument(
        "--pool-arg",
        action="append",
        default=[],
        help="pool arguments, e.g. --pool-arg=--extent-size=1GiB (repeatable; rows record them)",
    )
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds; a case that would end later is skipped")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.command = " ".join(["python3", "benchmarks/service_ttft_gpu.py", *(sys.argv[1:] if argv is None else argv)])
    started = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    args.log_dir = os.path.join(args.out, "service_ttft_logs")
    os.makedirs(args.log_dir, exist_ok=True)
    path = os.path.join(args.out, "service_ttft.json")
    rows = json.load(open(path)) if os.path.exists(path) else []

    def setup(pool_args, replica_args) -> tuple:  # a case per pool and replica set-up
        return tuple(pool_args), tuple(replica_args)

    have = {(r["model"], r["prompt_tokens"], setup(r.get("pool_args", ()), r.get("replica_args", ()))) for r in rows}
    rate, measured, gpu_bytes = measure_h2d(args.device)
    what = "host copy" if args.device == "cpu" else "pinned H2D"
    print(f"{what} {rate / 1e9:.1f} GB/s ({'measured' if measured else 'assumed'})", flush=True)
    rng = np.random.default_rng(args.seed + int(time.time()))  # fresh prompts: nothing cached by an earlier run
    signal.signal(signal.SIGTERM, _interrupt)  # timeout(1): stop the cluster, keep the rows
    from kvshare.engine.presets import PRESETS

    try:
        for model, tokens in args.cases:
            plan = plan_case(model, tokens, args, gpu_bytes)
            args.vocab = min(PRESETS[model].config.vocab_size, 256 if model in ("tiny", "qwen3.5-tiny") else 150000)
            if (model, plan["prompt_tokens"], setup(args.pool_arg, args.replica_arg)) in have:
                print(f"{model} {plan['prompt_tokens']}: in {path} already", flush=True)
                continue
            if plan["layout"] is None:
                print(f"{model} {plan['prompt_tokens']}: skipped (does not fit the GPU)", flush=True)
                continue
            need = estimate_s(plan, len(args.paths))
            if time.monotonic() - started + need > args.time_budget:
                print(
                    f"{model} {plan['prompt_tokens']}: skipped (needs ~{need:.0f} s, the budget has "
                    f"{args.time_budget - (time.monotonic() - started):.0f})",
                    flush=True,
                )
                continue
            t0 = time.monotonic()
            new = run_case(plan, args, (rate, measured), rng)
            for r in new:
                print(line(r), flush=True)
            print(f"  ({plan['layout']}, {time.monotonic() - t0:.0f} s; estimate {need:.0f} s)", flush=True)
            rows += new
            with open(path, "w") as f:
                json.dump(rows, f, indent=1)
    except KeyboardInterrupt:
        print("stopped: the clusters were stopped, the rows so far are kept", flush=True)
    print(
        "\n| model | prompt | path | request | cold s | cross s | local s | bound s | cross/bound | verified | equal |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['prompt_tokens']} | {r['path']} | {'first' if r['first_request'] else 'steady'} | "
            f"{fmt(r['cold_s'])} | {fmt(r['cross_s'])} | {fmt(r['local_s'])} | {fmt(r['bound_s'])} | "
            f"{fmt(r['cross_over_bound'], '.2f')} | {r['verified']} | {r['tokens_equal']} ({r.get('output_verdict')}) |"
        )
    # B's outputs must equal A's or part at a near tie (the fast mode's bf16 rounding); a mismatch fails
    return 0 if rows and all(r.get("output_verdict") in ("equal", "near-tie") and r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
