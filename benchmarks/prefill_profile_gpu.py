"""Where a cold prefill's GPU time goes, kernel by kernel: the built-in engine beside vLLM 0.26.

    # the GPU machine, .vk/ holding the vLLM bundle (benchmarks/vs_vllm.sh's set-up); 4-5 minutes at 32k
    export VK=.vk; source benchmarks/vllm_bundle.sh
    python3 -m kvshare make-model qwen3-8b --out /tmp/vs-vllm-qwen3-8b --device cuda
    python3 benchmarks/prefill_profile_gpu.py --model-dir /tmp/vs-vllm-qwen3-8b --tokens 32768 --out $OUT/profile
    PYTHONPATH=$PWD python3 benchmarks/prefill_profile_gpu.py --preset tiny --device cpu --tokens 512 \\
        --out /tmp/pp --no-vllm                                   # CPU dry run: operators instead of kernels

Built-in engine (this process): the engine as engine_ttft_gpu.py builds it (no pool), one short warm-up prefill,
two cold prefills of fresh random prompts timed without the profiler (wall, CUDA-synced), then one more under
torch.profiler (CPU and CUDA activities). Every prefill is checked to have computed all of its tokens (no reuse).
vLLM (a server of --vllm-python, its torch profiler on through --profiler-config): one warm-up request, two timed
cold requests, then /start_profile, one cold request, /stop_profile, and the trace its worker wrote.
vLLM runs as `vs_vllm.py` started it for the cold figures it compares (vLLM's defaults: torch.compile, CUDA
graphs, chunked prefill) but without a KV offloading tier. Its trace covers its worker's steps between the two
calls (VLLM_TRACE_COVERS); the built-in engine's covers the one request, from generate() to its first token.

Both traces go through prefill_profile_trace.py: per category of kernel name, count, GPU ms and share; the top
kernels; GPU busy time against span and wall (the gaps: launch and host overhead); the GEMM category's rate from
the model's linear FLOPs against the matmul rate (8192^3, bf16). Names alone file the built-in engine's unfused
RMSNorm and RoPE (float casts, pow, mean, mul, cat, neg) under copies and elementwise, so its profiled prefill
runs inside profiler ranges around the model's parts (``annotated_regions``) and a second table gives its time by
part. On CPU (the dry run) the events are the operators, each by its self time.
Writes ``--out``/prefill_profile.json and the traces (kvshare_trace.json.gz, vllm-trace/).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # engine_ttft_gpu and prefill_profile_trace beside this script
from engine_ttft_gpu import flops_attention, flops_prefill  # noqa: E402
from prefill_profile_trace import (  # noqa: E402
    REGION_PREFIX,
    TOP_KERNELS,
    UNANNOTATED,
    assign_regions,
    by_region,
    read_trace,
    summarise,
    table,
    trace_events,
)

VLLM_TRACE_COVERS = (
    "the worker's steps between /start_profile and /stop_profile: the prompt's prefill in steps of "
    "max_num_batched_tokens (8192 on an 80 GB GPU), compiled by torch.compile and run outside CUDA graphs (a step "
    "of that many tokens is above the capture sizes), and the sampling of the one output token"
)


@contextlib.contextmanager
def annotated_regions(model):
    """Bench-only instrumentation of the built-in model (kvshare.engine.model.Transformer), undone on exit:
    ``region:`` profiler ranges around its parts (modules by forward hooks; RoPE, the KV write, attention and the
    LM head by wrapping), so each kernel can be given the part of the model that launched it."""
    import torch
    from torch import nn

    import kvshare.engine.grid as g
    import kvshare.engine.model as m

    def wrap(label, fn):
        def annotated(*args, **kwargs):
            with torch.profiler.record_function(REGION_PREFIX + label):
                return fn(*args, **kwargs)

        return annotated

    open_ranges: list = []

    def enter(label):
        def hook(module, args):
            open_ranges.append(torch.profiler.record_function(REGION_PREFIX + label).__enter__())

        return hook

    def leave(module, args, out):
        open_ranges.pop().__exit__(None, None, None)

    kinds = {m.RMSNorm: "norm", nn.Linear: "linear", m.MLP: "MLP (act, mul)", nn.Embedding: "embedding"}
    handles = []
    for module in model.modules():
        if type(module) in kinds:
            handles += [
                module.register_forward_pre_hook(enter(kinds[type(module)])),
                module.register_forward_hook(leave),
            ]
    functions = {"apply_rope": "rotary", "write_kv": "KV write", "attend": "attention"}
    saved = {name: getattr(m, name) for name in functions}
    # the deterministic mode's grid step calls the KV write and SDPA attention by its own names
    grid_functions = {"write_kv": "KV write", "attend": "attention"}
    grid_saved = {name: getattr(g, name) for name in grid_functions}
    prefill_attention = model.prefill_attention
    try:
        for name, label in functions.items():
            setattr(m, name, wrap(label, saved[name]))
        for name, label in grid_functions.items():
            setattr(g, name, wrap(label, grid_saved[name]))
        if prefill_attention is not None:
            model.prefill_attention = wrap("attention", prefill_attention)
        model.logits = wrap("LM head", model.logits)  # an instance attribute over the method
        yield
    finally:
        del model.logits
        model.prefill_attention = prefill_attention
        for name in functions:
            setattr(m, name, saved[name])
        for name in grid_functions:
            setattr(g, name, grid_saved[name])
        for handle in handles:
            handle.remove()


def random_ids(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(4, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_tflops(device: str, dtype: str, repeats: int = 5) -> float:
    """The best of ``repeats`` matmuls of 8192^3 (512^3 on CPU) in the model's dtype (bf16 for the 8B shape)."""
    import torch

    size = 8192 if device.startswith("cuda") else 512
    a = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    a @ a
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        a @ a
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def profile_kvshare(args, out_dir: str) -> tuple[dict, object]:
    """The built-in engine's cold prefills: timed, then one profiled; returns the rows and the model config."""
    import torch

    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, SamplingParams

    n, device = args.tokens, args.device
    engine = Engine(
        EngineConfig(
            model=args.model_dir or args.preset,
            device=device,
            max_model_len=n + 64,
            deterministic=args.deterministic,
            grid_tokens=args.grid_tokens,
        )
    )
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def prefill(ids: list[int], around=contextlib.nullcontext()) -> float:
        before = engine.stats()
        with around:
            sync(device)
            t0 = time.perf_counter()
            stream = engine.generate(ids, params)
            event = next(stream)
            sync(device)
            wall = time.perf_counter() - t0
        stream.close()  # publishing the prompt's chunks (local cache) is no part of the prefill
        computed = engine.stats().prompt_tokens_computed - before.prompt_tokens_computed
        p = event.provenance
        if p.local_tokens or p.pool_tokens or computed != len(ids):
            raise RuntimeError(f"a cold prefill reused KV: {p} ({computed} of {len(ids)} tokens computed)")
        return wall

    prefill(random_ids(min(300, n // 2), 0))  # warm-up: kernel plans, allocator
    walls = [prefill(random_ids(n, seed)) for seed in (1, 2)]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    with annotated_regions(engine.model):
        profiled = prefill(random_ids(n, 3), profiler)
    path = os.path.join(out_dir, "kvshare_trace.json.gz")
    profiler.export_chrome_trace(path)
    row = {"wall_s": walls, "profiled_wall_s": profiled, "attention": engine.attention.name}
    row["trace_file"] = os.path.basename(path)
    row["trace_covers"] = "the one request, from generate() to its first token"
    engine.close()  # its memory goes back once this frame is gone (main empties the CUDA cache then)
    return {**row, "trace": read_trace(path)}, engine.model_config


def post(url: str, body: dict | None, timeout_s: float) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        text = response.read()
    return json.loads(text) if text.strip() else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profile_vllm(args, out_dir: str, gpu_memory_utilization: float | None) -> dict:
    """vLLM's cold prefills through its OpenAI server: timed, then one under its torch profiler."""
    from kvshare.integrations.vllm.launch import VllmServerConfig, vllm_server_command, wait_until_ready

    n, trace_dir = args.tokens, os.path.join(out_dir, "vllm-trace")
    os.makedirs(trace_dir, exist_ok=True)
    profiler = {
        "profiler": "torch",
        "torch_profiler_dir": trace_dir,
        "torch_profiler_with_stack": False,
        "torch_profiler_dump_cuda_time_total": False,
        "ignore_frontend": True,  # only the worker's trace (CPU and CUDA)
    }
    on_gpu = args.device.startswith("cuda")
    config = VllmServerConfig(
        model=args.model_dir,
        port=free_port(),
        python=args.vllm_python,
        max_model_len=n + 64,
        dtype="bfloat16" if on_gpu else "auto",
        device="cuda" if on_gpu else "cpu",
        gpu_memory_utilization=gpu_memory_utilization,
        extra_args=("--profiler-config", json.dumps(profiler)),
    )
    spec = vllm_server_command(config)
    log = open(os.path.join(out_dir, "vllm.log"), "w")
    proc = subprocess.Popen(spec.argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    row: dict = {"command": " ".join(spec.argv), "trace_covers": VLLM_TRACE_COVERS}
    try:
        wait_until_ready(spec.base_url, proc, timeout_s=args.vllm_timeout)
        name = os.path.basename(os.path.normpath(args.model_dir))

        def complete(ids: list[int]) -> float:
            body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
            t0 = time.perf_counter()
            reply = post(f"{spec.base_url}/v1/completions", body, args.request_timeout)
            wall = time.perf_counter() - t0
            cached = ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached != 0:  # None: vLLM did not say, and a cold figure must not rest on a guess
                raise RuntimeError(f"vLLM reused {cached} prompt tokens of a cold prompt (None: not reported)")
            return wall

        complete(random_ids(300, 0))
        row["wall_s"] = [complete(random_ids(n, seed)) for seed in (11, 12)]
        post(f"{spec.base_url}/start_profile", None, args.request_timeout)
        row["profiled_wall_s"] = complete(random_ids(n, 13))
        post(f"{spec.base_url}/stop_profile", None, args.request_timeout)
        deadline = time.monotonic() + args.request_timeout
        while not (files := glob.glob(os.path.join(trace_dir, "*.pt.trace.json*"))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM wrote no trace into {trace_dir} within {args.request_timeout:.0f} s")
            time.sleep(1.0)
        path = max(files, key=os.path.getsize)
        row["trace_file"], row["trace"] = os.path.relpath(path, out_dir), read_trace(path)
    except Exception as exc:  # the kvshare table is printed whatever became of vLLM
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
        log.close()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", help="a model directory (kvshare make-model qwen3-8b --out DIR)")
    p.add_argument("--preset", default="qwen3-8b", help="the built-in engine's preset where no --model-dir")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--out", required=True)
    p.add_argument("--vllm-python", help="vLLM's interpreter (default: this one, where it imports vllm)")
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--deterministic", action="store_true", help="the built-in engine in its deterministic mode")
    p.add_argument("--grid-tokens", type=int, help="the deterministic mode's grid (default: the pool's chunk)")
    # vLLM 0.26's server took 160 s to get ready for the 8B shape on an H100 (torch.compile 40 s, no compile cache)
    p.add_argument("--vllm-timeout", type=float, default=240.0, help="seconds for vLLM's server to get ready")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds for one request or the trace")
    args = p.parse_args(argv)
    if args.vllm_python is None and importlib.util.find_spec("vllm") is not None:
        args.vllm_python = sys.executable
    run_vllm = not args.no_vllm and args.vllm_python is not None and args.model_dir is not None
    os.makedirs(args.out, exist_ok=True)
    import torch

    from kvshare.bench.records import tree_commit

    on_gpu = args.device.startswith("cuda")
    result: dict = {"commit": tree_commit(), "tokens": args.tokens, "device": args.device, "engines": {}}
    if on_gpu:
        result["gpu"] = torch.cuda.get_device_name(args.device)
    kv, model_config = profile_kvshare(args, args.out)
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()  # the engine's memory, before vLLM's server measures what is free
    result["matmul_tflops"] = matmul_tflops(args.device, model_config.dtype)
    result["matmul_dtype"] = model_config.dtype
    gemm_flops = flops_prefill(model_config, args.tokens) - flops_attention(model_config, args.tokens)
    result["flops"] = {"prefill": flops_prefill(model_config, args.tokens), "gemm": gemm_flops}
    engines = {"kvshare": kv}
    if run_vllm:
        share = None
        if on_gpu:  # what this process still holds (its CUDA context) stays out of vLLM's share of the GPU
            free, total = torch.cuda.mem_get_info()
            share = result["vllm_gpu_memory_utilization"] = round(min(0.85, free / total - 0.05), 2)
        engines["vLLM"] = profile_vllm(args, args.out, share)
    elif not args.no_vllm:
        print("prefill_profile: vLLM not run (no --model-dir, or no interpreter that imports vllm)", flush=True)
    summaries = {}
    for name, row in engines.items():
        trace = row.pop("trace", None)
        if trace is not None:
            events = trace_events(trace, on_gpu)
            assign_regions(trace, events)
            summaries[name] = s = summarise(events, row["profiled_wall_s"], gemm_flops)
            if any(e["region"] != UNANNOTATED for e in events):  # the built-in engine's parts (annotated_regions)
                s["regions"] = by_region(events)
            s["gemm_pct_of_matmul"] = 100 * s["gemm_tflops"] / result["matmul_tflops"] if s["gemm_tflops"] else None
        result["engines"][name] = {**row, **summaries.get(name, {})}
        if "error" in row:
            print(f"prefill_profile: {name}: {row['error']}", flush=True)
    with open(os.path.join(args.out, "prefill_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    where = result.get("gpu", args.device)
    print(f"{args.tokens} tokens on {where}, {model_config.dtype} matmul {result['matmul_tflops']:.2f} TFLOP/s")
    for name, row in result["engines"].items():
        walls = ", ".join(f"{w:.3f}" for w in row.get("wall_s", []))
        print(f"{name}: cold prefill wall {walls} s (profiled {row.get('profiled_wall_s') or 0:.3f} s)")
    print(table(summaries))
    for name, s in summaries.items():
        if "regions" in s:
            print(f"\n{name} by part of the model (the range open where each kernel was launched; top categories)")
            for region, r in s["regions"].items():
                cats = sorted(r["categories"].items(), key=lambda kv: -kv[1])[:3]
                top = ", ".join(f"{c} {ms:.2f}" for c, ms in cats)
                print(f"  {region:18s} {r['ms']:9.2f} ms {r['share']:6.1%} {r['count']:6d}x  ({top})")
        print(f"\n{name}: top {TOP_KERNELS} kernels")
        for k in s["top"]:
            print(f"  {k['ms']:9.2f} ms {k['count']:6d}x  {k['category']:18s} {k['name'][:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
