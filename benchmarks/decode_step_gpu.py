"""Decode step time on the GPU, eager against CUDA graphs (kvshare.engine.decode_graph), same run.

For each context length: a KV of that many tokens (random values: a step's time does not depend on
them), then STEPS decode steps eager (``Transformer.forward`` of one token, as ``--enforce-eager``) and
STEPS replayed from graphs, alternating in rounds so that drift of the machine hits both; each step is
timed to its logits on the host (a sampled token needs them there). Also: the graphs' logits against
the eager step's for the same token and position (max |difference|, same argmax), and the capture time.
With ``--beside-copies`` also graph steps while another thread copies the KV out chunk by chunk (what the
engine's publish thread does beside the decode: one small copy of a chunk after another), once with
Python's default GIL switch interval and once with 0.1 ms: whether that thread's Python slows the steps.

    PYTHONPATH=. python3 benchmarks/decode_step_gpu.py --model qwen3-8b --contexts 32768,131072 --out decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.decode_graph import DecodeGraphs
from kvshare.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--steps", type=int, default=20, help="steps of each kind per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--beside-copies", action="store_true", help="also steps beside a thread copying KV chunks")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    engine = Engine(
        EngineConfig(
            model=args.model,
            device="cuda",
            max_model_len=max(contexts) + 1024,
            preallocate_kv=False,
            enforce_eager=True,
            local_cache_bytes=0,
        )
    )
    mc, model = engine.model_config, engine.model
    rows = []
    for context in contexts:
        capacity = context + args.steps * args.rounds * 2 + 256
        kv = torch.empty(mc.num_layers, 2, mc.num_kv_heads, capacity, mc.head_dim, dtype=torch.bfloat16, device="cuda")
        kv.normal_(0, 1)
        graphs = DecodeGraphs(model, kv)
        with torch.inference_mode():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graphs.capture()
            torch.cuda.synchronize()
            capture_s = time.perf_counter() - t0
            saved = kv[:, :, :, context].clone()
            eager = model(torch.tensor([17], device="cuda"), kv, context).clone()
            kv[:, :, :, context].copy_(saved)
            replayed = graphs.run(17, context).clone()
            diff = float((eager - replayed).abs().max())
            same_argmax = int(eager.argmax()) == int(replayed.argmax())
            times = {"eager": [], "graphs": []}
            position = context
            for _ in range(args.rounds):
                for kind in ("eager", "graphs"):
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        if kind == "eager":
                            logits = model(torch.tensor([17], device="cuda"), kv, position)
                        else:
                            logits = graphs.run(17, position)
                        int(logits[0].argmax())  # the host needs the token
                        times[kind].append(time.perf_counter() - t)
                        position += 1
            if args.beside_copies:
                for name, interval in (
                    ("graphs_beside_copies", sys.getswitchinterval()),
                    ("graphs_beside_copies_0.1ms", 1e-4),
                ):
                    default_interval = sys.getswitchinterval()
                    sys.setswitchinterval(interval)
                    try:
                        times[name], position = _beside_copies(graphs, kv, position, args.steps * args.rounds)
                    finally:
                        sys.setswitchinterval(default_interval)
        eager_ms = statistics.median(times["eager"]) * 1e3
        graph_ms = statistics.median(times["graphs"]) * 1e3
        row = {
            "model": args.model,
            "context": context,
            "eager_ms": round(eager_ms, 3),
            "graphs_ms": round(graph_ms, 3),
            "speedup": round(eager_ms / graph_ms, 2),
            "eager_p90_ms": round(_p90(times["eager"]) * 1e3, 3),
            "graphs_p90_ms": round(_p90(times["graphs"]) * 1e3, 3),
            "capture_s": round(capture_s, 3),
            "max_abs_logit_diff": diff,
            "same_argmax": same_argmax,
            "steps_each": len(times["eager"]),
        }
        for name in ("graphs_beside_copies", "graphs_beside_copies_0.1ms"):
            if name in times:
                row[name + "_ms"] = round(statistics.median(times[name]) * 1e3, 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del graphs, kv, saved
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(
            {
                "command": "benchmarks/decode_step_gpu.py "
                + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "rows": rows,
            },
            f,
            indent=1,
        )


def _beside_copies(graphs: DecodeGraphs, kv: torch.Tensor, position: int, steps: int) -> tuple[list[float], int]:
    """Graph steps while a thread copies 256-token chunks of the KV one by one (until the steps end)."""
    stop = threading.Event()

    def copy_chunks():
        with torch.inference_mode():
            i = 0
            while not stop.is_set():
                kv[:, :, :, (i % 64) * 256 : (i % 64 + 1) * 256].clone()
                i += 1

    thread = threading.Thread(target=copy_chunks, daemon=True)
    thread.start()
    times = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            int(graphs.run(17, position)[0].argmax())
            times.append(time.perf_counter() - t)
            position += 1
    finally:
        stop.set()
        thread.join()
    return times, position


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


if __name__ == "__main__":
    main()
