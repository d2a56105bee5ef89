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

Both traces go through one categoriser (``category``: the kernel's name against RULES, first match wins) and one
summary: per category the kernel count, GPU ms and share of the summed kernel time, the top kernels, the GPU busy
time (union of the kernels' intervals) against the span and the host's wall time (the gaps: launch and host
overhead), and the GEMM category's rate from the model's linear FLOPs against the matmul rate (8192^3, bf16).
On CPU the events are the operators, each with its self time (its children's time taken out).
Names alone put the built-in engine's unfused RMSNorm and RoPE (float casts, pow, mean, mul, cat, neg) under
copies and elementwise; its profiled prefill therefore also runs with profiler ranges around the model's parts
(``annotated_regions``), and a second table gives its time by part: the range open where each kernel was launched.
Writes ``--out``/prefill_profile.json and the traces (kvshare_trace.json.gz, vllm-trace/).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import gzip
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # engine_ttft_gpu beside this script
from engine_ttft_gpu import flops_attention, flops_prefill  # noqa: E402

# (category, pattern over the lower-cased kernel or operator name); the first match wins, so vLLM's KV write
# (reshape_and_cache_flash_kernel) is a KV write before "flash" makes it attention, FlashAttention's kernels
# (whose names hold cutlass and sm90 templates) are attention before GEMM is tried, and fused norms (rsqrt) or
# activations (silu) come before the copies and plain elementwise kernels they may be fused with. A reduction
# (the mean of an unfused RMSNorm, a sampler's argmax) matches none: "other".
RULES: tuple[tuple[str, str], ...] = (
    ("KV write / copies", r"reshape_and_cache|kv_cache_update"),
    ("attention", r"flash|fmha|attn|attention"),
    ("GEMM", r"cutlass|sm90_|gemm|cublas|nvjet|xmma|wgmma|^aten::(mm|addmm|bmm|matmul|linear)$"),
    ("norm", r"rms_?norm|layer_?norm|rsqrt"),
    ("rotary", r"rotary|rope"),
    ("activation", r"silu|gelu|act_and_mul"),
    ("KV write / copies", r"reshape_and_cache|copy|memcpy|memset|(^|[^a-z])cat|index|scatter|gather"),
    ("elementwise other", r"elementwise|triton_poi|triton_red|^aten::(add|mul|div|sub|neg|pow|exp)_?$"),
)
OTHER = "other"
REGION_PREFIX, UNANNOTATED = "region:", "rest"  # rest: residual adds, copies of q and x, the sampler
VLLM_TRACE_COVERS = (
    "the worker's steps between /start_profile and /stop_profile: the prompt's prefill in steps of "
    "max_num_batched_tokens (8192 on an 80 GB GPU), compiled by torch.compile and run outside CUDA graphs (a step "
    "of that many tokens is above the capture sizes), and the sampling of the one output token"
)
CATEGORIES = ("GEMM", "attention", "norm", "rotary", "activation", "KV write / copies", "elementwise other", OTHER)
_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in RULES)
TOP_KERNELS = 15


def category(name: str) -> str:
    """The category of one kernel (or CPU operator) name; OTHER where no rule matches."""
    lowered = name.lower()
    return next((cat for cat, pattern in _COMPILED if pattern.search(lowered)), OTHER)


def trace_events(trace: dict, on_gpu: bool) -> list[dict]:
    """The compute events of a chrome trace as {name, ts, dur, self} (us): on a GPU its kernels, memcpys and
    memsets (self = dur); on CPU its operators, self being dur less that of the operators directly inside it."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset") if on_gpu else ("cpu_op",)
    raw = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    # a kernel was issued where its launch (the runtime call of the same correlation id) ran on a host thread
    launches = {
        e["args"]["correlation"]: e
        for e in raw
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    events = []
    for e in raw:
        if e.get("cat") in kinds:
            launch = launches.get(e.get("args", {}).get("correlation")) if on_gpu else e
            at = ((launch.get("pid"), launch.get("tid")), float(launch["ts"])) if launch else None
            events.append({"name": e["name"], "ts": float(e["ts"]), "dur": float(e.get("dur", 0)), "at": at})
    for e in events:
        e["self"] = e["dur"]
    if not on_gpu:  # nested operators of one thread: take each one's time out of its enclosing one
        stacks: dict = {}
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            stack = stacks.setdefault(e["at"][0], [])
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1]["self"] -= e["dur"]
            stack.append(e)
    return events


def assign_regions(trace: dict, events: list[dict]) -> None:
    """Each event's "region": the innermost ``region:`` range (``annotated_regions``) open on the host thread where
    it was issued, else UNANNOTATED. The ranges of one thread nest, so one sweep over the time points does it."""
    spans = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith(REGION_PREFIX)
    ]
    items: dict = {}
    for e in spans:  # starts before points at one time, outer ranges before inner ones
        items.setdefault((e.get("pid"), e.get("tid")), []).append((float(e["ts"]), 0, -float(e["dur"]), e))
    for i, e in enumerate(events):
        e["region"] = UNANNOTATED
        if e["at"] is not None:
            items.setdefault(e["at"][0], []).append((e["at"][1], 1, i, e))
    for thread_items in items.values():
        stack: list[dict] = []
        for ts, kind, _, obj in sorted(thread_items, key=lambda t: t[:3]):
            while stack and float(stack[-1]["ts"]) + float(stack[-1]["dur"]) <= ts:
                stack.pop()
            if kind == 0:
                stack.append(obj)
            elif stack:
                obj["region"] = stack[-1]["name"][len(REGION_PREFIX) :]


def by_region(events: list[dict]) -> dict[str, dict]:
    """Per region: count, ms, share of the summed event time and its ms per category."""
    total_ms = sum(e["self"] for e in events) / 1e3
    out: dict[str, dict] = {}
    for e in events:
        row = out.setdefault(e["region"], {"count": 0, "ms": 0.0, "categories": {}})
        row["count"] += 1
        row["ms"] += e["self"] / 1e3
        c = category(e["name"])
        row["categories"][c] = row["categories"].get(c, 0.0) + e["self"] / 1e3
    for row in out.values():
        row["share"] = row["ms"] / total_ms if total_ms else 0.0
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


@contextlib.contextmanager
def annotated_regions(model):
    """Bench-only instrumentation of the built-in model (kvshare.engine.model.Transformer), undone on exit:
    ``region:`` profiler ranges around its parts (modules by forward hooks; RoPE, the KV write, attention and the
    LM head by wrapping), so each kernel can be given the part of the model that launched it."""
    import torch
    from torch import nn

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
    prefill_attention = model.prefill_attention
    try:
        for name, label in functions.items():
            setattr(m, name, wrap(label, saved[name]))
        if prefill_attention is not None:
            model.prefill_attention = wrap("attention", prefill_attention)
        model.logits = wrap("LM head", model.logits)  # an instance attribute over the method
        yield
    finally:
        del model.logits
        model.prefill_attention = prefill_attention
        for name in functions:
            setattr(m, name, saved[name])
        for handle in handles:
            handle.remove()


def read_trace(path: str) -> dict:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


def busy_us(events: list[dict]) -> float:
    """Time covered by at least one event (the union of their intervals)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        if stop > start:
            total += stop - start
        end = max(end, stop)
    return total


def summarise(events: list[dict], wall_s: float | None, gemm_flops: float | None) -> dict:
    """Per category (count, ms, share of the summed event time), the top kernels, busy vs span vs wall."""
    per = {c: {"count": 0, "ms": 0.0} for c in CATEGORIES}
    names: dict[str, dict] = {}
    for e in events:
        row = per[category(e["name"])]
        row["count"] += 1
        row["ms"] += e["self"] / 1e3
        one = names.setdefault(e["name"], {"count": 0, "ms": 0.0, "category": category(e["name"])})
        one["count"] += 1
        one["ms"] += e["self"] / 1e3
    total_ms = sum(r["ms"] for r in per.values())
    for r in per.values():
        r["share"] = r["ms"] / total_ms if total_ms else 0.0
    top = sorted(names.items(), key=lambda kv: -kv[1]["ms"])[:TOP_KERNELS]
    span_ms = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3 if events else 0.0
    gemm_s = per["GEMM"]["ms"] / 1e3
    return {
        "categories": per,
        "kernel_ms": total_ms,
        "num_kernels": len(events),
        "busy_ms": busy_us(events) / 1e3,
        "span_ms": span_ms,
        "profiled_wall_ms": wall_s * 1e3 if wall_s is not None else None,
        "gemm_tflops": gemm_flops / gemm_s / 1e12 if gemm_flops and gemm_s else None,
        "top": [{"name": name, **row} for name, row in top],
    }


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
    engine = Engine(EngineConfig(model=args.model_dir or args.preset, device=device, max_model_len=n + 64))
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


def profile_vllm(args, out_dir: str) -> dict:
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
        gpu_memory_utilization=0.85 if on_gpu else None,  # this process keeps its CUDA context
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


def table(engines: dict[str, dict]) -> str:
    """category | ms and share per engine | the first engine's ms less the second's."""
    names = list(engines)
    diff_head = f" | {names[0]} - {names[1]} ms" if len(names) == 2 else ""
    lines = [f"{'category':20s}" + "".join(f" | {n + ' ms':>11s} {'share':>6s}" for n in names) + diff_head]
    for c in (*CATEGORIES, None):
        cells, ms = "", []
        for n in names:
            s = engines[n]
            v = s["categories"][c]["ms"] if c else s["kernel_ms"]
            ms.append(v)
            share = f"{s['categories'][c]['share']:6.1%}" if c else f"{'':6s}"
            cells += f" | {v:11.2f} {share}"
        diff = f" | {ms[0] - ms[1]:+.2f}" if len(ms) == 2 else ""
        lines.append(f"{c or 'all kernels':20s}{cells}{diff}")
    for key in ("num_kernels", "busy_ms", "span_ms", "profiled_wall_ms", "gemm_tflops", "gemm_pct_of_matmul"):
        lines.append(f"{key:20s}" + "".join(f" | {engines[n][key] or 0:18.2f}" for n in names))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", help="a model directory (kvshare make-model qwen3-8b --out DIR)")
    p.add_argument("--preset", default="qwen3-8b", help="the built-in engine's preset where no --model-dir")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--out", required=True)
    p.add_argument("--vllm-python", help="vLLM's interpreter (default: this one, where it imports vllm)")
    p.add_argument("--no-vllm", action="store_true")
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
        engines["vLLM"] = profile_vllm(args, args.out)
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
