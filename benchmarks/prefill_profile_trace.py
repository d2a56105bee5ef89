"""benchmarks/prefill_profile_gpu.py's reading of a torch profiler trace (pure): each kernel's category by its
name, on CPU each operator's self time, each event's region (the built-in model's part), the per-category and
per-region sums, busy time against span, and the side-by-side table."""

from __future__ import annotations

import gzip
import json
import re

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
    ("elementwise other", r"elementwise|triton_|^aten::(add|mul|div|sub|neg|pow|exp)_?$"),
)
OTHER = "other"
REGION_PREFIX, UNANNOTATED = "region:", "rest"  # rest: residual adds, copies of q and x, the sampler
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
