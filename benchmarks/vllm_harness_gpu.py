"""The vLLM connector on the H200, vLLM-shaped: replica A computes and stores, replica B (a fresh process) loads.

    PYTHONPATH=. python3 benchmarks/vllm_harness_gpu.py --out DIR [--cases 8b:32768,8b:131072,32b:32768,32b:131072]
    PYTHONPATH=. python3 benchmarks/vllm_harness_gpu.py --out DIR --cases tiny:1024 --device cpu
        (the last: a dry run of the logic)

vLLM cannot be installed on the GPU machine, so the connector's own scheduler and worker objects
(PoolScheduler; WorkerHooks over the GPU worker, kvshare.integrations.vllm.gpu, which KVShareConnector
forwards vLLM's calls to) are driven in the order vLLM 0.32's GPU model runner calls them, over
vLLM-shaped flash-attention KV (NHD memory, block size 16) and a real decoder layer's compute of the
Qwen3-8B / 32B shapes in bf16 (benchmarks/vllm_harness_replica.py). Per case, against a pool sized
for it: A stores every full chunk without compute (store bandwidth), computes the prefix cold and
the suffix over its own KV; B loads (with and without verification), runs the real step (the load
beside the suffix's compute) and the suffix's compute alone. Each replica also times one contiguous
pinned copy of the same bytes in the same run. Per case, in DIR/vllm_harness.json and a table:

    load_ratio_vs_pinned   pinned H2D time / load time (same bytes)      target >= 0.9
    store_ratio_vs_pinned  pinned D2H time / store time (same bytes)     target >= 0.9
    step_over_bound        real step / max(load alone, suffix compute)   target <= 1.15
    verify_share_of_load   (verified load - unverified load) / verified  target <= 0.05
    tokens_equal           B's next tokens (argmax over the suffix) == A's, with the logits compared bitwise
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = {"8b": "qwen3-8b", "32b": "qwen3-32b", "tiny": "tiny"}
DEFAULT_CASES = "8b:32768,8b:131072,32b:32768,32b:131072"
EXTENT_MIB = 512
ROW_FIELDS = (
    "model",
    "prompt_tokens",
    "prefix_tokens",
    "suffix_tokens",
    "load_bytes",
    "load_s",
    "load_gbps",
    "pinned_h2d_gbps",
    "load_ratio_vs_pinned",
    "store_bytes",
    "store_s",
    "store_gbps",
    "pinned_d2h_gbps",
    "store_ratio_vs_pinned",
    "load_unverified_s",
    "verify_share_of_load",
    "compute_s",
    "step_s",
    "step_over_bound",
    "tokens_equal",
    "logits_bitwise_equal",
    "max_abs_logit_diff",
    "first_divergence",
    "top2_gap_at_divergence",
    "load_complete",
    "cold_prefill_s",
    "register_s",
    "error",
)


@dataclass(frozen=True)
class Case:
    model: str  # a key of MODELS
    prompt_tokens: int

    @property
    def preset(self) -> str:
        return MODELS[self.model]

    @property
    def name(self) -> str:
        return f"{self.model}:{self.prompt_tokens}"


def parse_cases(text: str) -> list[Case]:
    """``8b:32768,32b:128k`` -> cases; models are keys of MODELS, lengths tokens (``k`` = 1024)."""
    cases = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        model, sep, length = item.partition(":")
        if not sep or model not in MODELS:
            raise ValueError(f"case {item!r}: expected MODEL:TOKENS with MODEL one of {sorted(MODELS)}")
        tokens = int(length[:-1]) * 1024 if length.lower().endswith("k") else int(length)
        if tokens < 2 * 256:
            raise ValueError(f"case {item!r}: needs at least two 256-token chunks")
        cases.append(Case(model, tokens))
    if not cases:
        raise ValueError("no cases given")
    return cases


def pool_mib(page_bytes: int, prompt_tokens: int) -> int:
    """A pool holding the case's pages below the eviction watermark (0.95), in whole extents."""
    pages = prompt_tokens // 256
    need = pages * page_bytes / 0.85 + (256 << 20)
    extents = -(-int(need) // (EXTENT_MIB << 20))
    return max(extents, 1) * EXTENT_MIB


def compare_logits(a, b) -> dict:
    """A's and B's suffix logits [S, V]: next tokens equal? bitwise equal? where they first differ, and how close
    A's top two were there (DESIGN: identical up to the first step whose top-2 logprob gap is below 1e-3)."""
    import torch

    same_tokens = a.argmax(-1) == b.argmax(-1)
    differ = (~same_tokens).nonzero()
    first = int(differ[0, 0]) if differ.numel() else None
    gap = None
    if first is not None:
        top2 = torch.log_softmax(a[first].double(), -1).topk(2).values
        gap = float(top2[0] - top2[1])
    return {
        "tokens_equal": bool(same_tokens.all()),
        "logits_bitwise_equal": bool(torch.equal(a, b)),
        "max_abs_logit_diff": float((a - b).abs().max()),
        "first_divergence": first,
        "top2_gap_at_divergence": gap,
    }


def make_row(case: Case, a: dict, b: dict, logits: dict) -> dict:
    """One case's row from the two replicas' figures (pure; tested on CPU)."""
    load_s, unverified_s = min(b["load_s"]), min(b["load_unverified_s"])
    compute_s, step_s = min(b["compute_s"]), min(b["step_s"])
    load_bytes, store_bytes = b["load_bytes_per_step"], a["store_bytes"]
    row = {
        "model": case.preset,
        "prompt_tokens": case.prompt_tokens,
        "prefix_tokens": b["prefix_tokens"],
        "suffix_tokens": case.prompt_tokens - b["prefix_tokens"],
        "load_bytes": load_bytes,
        "load_s": load_s,
        "load_gbps": load_bytes / load_s / 1e9,
        "pinned_h2d_gbps": load_bytes / b["pinned_h2d_s"] / 1e9,
        "load_ratio_vs_pinned": b["pinned_h2d_s"] / load_s,
        "store_bytes": store_bytes,
        "store_s": a["store_s"],
        "store_gbps": store_bytes / a["store_s"] / 1e9,
        "pinned_d2h_gbps": store_bytes / a["pinned_d2h_s"] / 1e9,
        "store_ratio_vs_pinned": a["pinned_d2h_s"] / a["store_s"],
        "store_again_s": a["store_again_s"],
        "store_again_ratio_vs_pinned": a["pinned_d2h_s"] / a["store_again_s"],
        "load_unverified_s": unverified_s,
        "verify_share_of_load": (load_s - unverified_s) / load_s,
        "compute_s": compute_s,
        "step_s": step_s,
        "step_over_bound": step_s / max(load_s, compute_s),
        **logits,
        "load_complete": b["incomplete_loads"] == 0
        and b["load_errors"] == 0
        and b["loaded_tokens"] == b["prefix_tokens"],
        "cold_prefill_s": a["cold_step_s"],
        "register_s": {"A": a["register_s"], "B": b["register_s"]},
        "error": None,
        "raw": {"A": a, "B": b},
    }
    return row


def error_row(case: Case, error: str) -> dict:
    return {
        **{field: None for field in ROW_FIELDS},
        "model": case.preset,
        "prompt_tokens": case.prompt_tokens,
        "error": error,
    }


def run_replica(
    role: str, case: Case, socket_path: str, device: str, tmp: str, timeout_s: float, profile: str | None = None
) -> dict:
    """One replica as a fresh process; its figures."""
    result, logits = os.path.join(tmp, f"{role}.json"), os.path.join(tmp, f"{role}_logits.pt")
    cmd = [
        sys.executable,
        os.path.join(HERE, "vllm_harness_replica.py"),
        "--role",
        role,
        "--preset",
        case.preset,
        "--tokens",
        str(case.prompt_tokens),
        "--socket",
        socket_path,
        "--device",
        device,
        "--logits",
        logits,
        "--result",
        result,
    ]
    if profile:
        os.makedirs(profile, exist_ok=True)
        cmd += ["--profile", profile]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout_s, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"replica {role} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    with open(result) as f:
        figures = json.load(f)
    figures["process_s"] = time.perf_counter() - started
    return figures


def run_case(case: Case, device: str, timeout_s: float, profile: str | None = None) -> dict:
    import torch

    from kvshare.engine.presets import PRESETS
    from kvshare.layout import KVLayout
    from kvshare.pool.spawn import running_pool

    c = PRESETS[case.preset].config
    page_bytes = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype, 256).page_bytes
    size = pool_mib(page_bytes, case.prompt_tokens)
    with (
        tempfile.TemporaryDirectory(prefix="vllm-harness-") as tmp,
        running_pool(f"{size}MiB", ("--extent-size", f"{min(EXTENT_MIB, size)}MiB"), quiet=True) as socket_path,
    ):
        where = os.path.join(profile, case.name.replace(":", "_")) if profile else None
        a = run_replica("A", case, socket_path, device, tmp, timeout_s, where)
        b = run_replica("B", case, socket_path, device, tmp, timeout_s, where)
        logits = compare_logits(
            torch.load(os.path.join(tmp, "A_logits.pt")), torch.load(os.path.join(tmp, "B_logits.pt"))
        )
    row = make_row(case, a, b, logits)
    row["pool_mib"] = size
    return row


def table(rows: list[dict]) -> str:
    head = (
        "case",
        "load GB/s",
        "pinned",
        "load x",
        "store GB/s",
        "pinned",
        "store x",
        "verify",
        "step/bound",
        "tokens",
    )
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        name = f"{r['model']} {r['prompt_tokens']}"
        if r.get("error"):
            lines.append(f"{name} | error: {r['error'].splitlines()[0][:120]}")
            continue
        lines.append(
            " | ".join(
                [
                    name,
                    f"{r['load_gbps']:.1f}",
                    f"{r['pinned_h2d_gbps']:.1f}",
                    f"{r['load_ratio_vs_pinned']:.2f}",
                    f"{r['store_gbps']:.1f}",
                    f"{r['pinned_d2h_gbps']:.1f}",
                    f"{r['store_ratio_vs_pinned']:.2f}",
                    f"{r['verify_share_of_load']:+.3f}",
                    f"{r['step_over_bound']:.2f} ({r['step_s'] * 1e3:.0f} ms)",
                    "equal"
                    if r["tokens_equal"]
                    else f"differ at {r['first_divergence']} (gap {r['top2_gap_at_divergence']:.2g})",
                ]
            )
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for vllm_harness.json")
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"MODEL:TOKENS,... (default {DEFAULT_CASES})")
    parser.add_argument("--device", default="cuda", help="cuda (the H200 run) or cpu (a dry run of the logic)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="longest run of one replica process")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="start no case after this many seconds (0: no limit); skipped cases get a row saying so",
    )
    parser.add_argument(
        "--profile", default=None, help="a directory for torch profiler traces (chrome JSON) of each step's first run"
    )
    args = parser.parse_args(argv)
    args.case_list = parse_cases(args.cases)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows, started = [], time.perf_counter()
    for case in args.case_list:
        elapsed = time.perf_counter() - started
        if args.budget_s and elapsed > args.budget_s:
            rows.append(error_row(case, f"skipped: {elapsed:.0f} s of the {args.budget_s:.0f} s budget were spent"))
        else:
            print(f"case {case.name} ...", flush=True)
            try:
                rows.append(run_case(case, args.device, args.timeout_s, args.profile))
            except Exception as exc:  # one case's failure is its row; the others still run
                rows.append(error_row(case, f"{type(exc).__name__}: {exc}"))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "raw"}), flush=True)
        report = {"device": _device_name(args.device), "cases": rows, "seconds": time.perf_counter() - started}
        with open(os.path.join(args.out, "vllm_harness.json"), "w") as f:  # after every case: a cut run keeps its rows
            json.dump(report, f, indent=1)
    print(table(rows))
    return 0 if all(not r.get("error") for r in rows) else 1


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device


if __name__ == "__main__":
    sys.exit(main())
