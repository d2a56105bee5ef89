#!/usr/bin/env python3
"""Real vLLM on a GPU: kvshare's cross-replica TTFT against the bound and against vLLM's own CPU offloading.

``kvshare`` (the default): ``kvshare up --engine vllm --device cuda --replicas 2`` (two vLLM replicas on one GPU,
one pool, vLLM's defaults: torch.compile and CUDA graphs on). Per prompt length, two fresh random token-id
prompts (the first is replica B's first request of the cluster, the second the steady state), each:

    A cold  ->  B cross-replica (B never saw it: the prefix comes from the pool)  ->  A again (vLLM's GPU hit)

``--engine vllm-offloading``: one plain vLLM server with ``--kv-offloading-size`` (vLLM's native CPU tier), per
prompt: cold, then vLLM's GPU prefix cache reset (``/reset_prefix_cache``, dev mode) and the same prompt again:
a hit from its CPU tier on the same replica (``local_s``).

TTFT is the time to the first streamed token (max_tokens 16, temperature 0, top-2 logprobs). The bound is the
cross request's loaded KV bytes (cached prompt tokens x KV bytes per token) over the pinned host->device
bandwidth measured in this run (torch, 1 GiB). Greedy tokens of B's cross run are compared with A's cold run:
``tokens_equal``, else ``first_divergence`` and the cold run's top-2 logprob gap there. Rows go to OUT/rows.json
as each is taken; the servers' output to OUT/<engine>.log.

    python3 benchmarks/vllm_gpu.py --model-dir /tmp/m8b --lengths 32768 131072 --out $OUT
    python3 benchmarks/vllm_gpu.py --engine vllm-offloading --model-dir /tmp/m8b --lengths 32768 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float) -> dict:
    """One streamed greedy completion: ttft_s, the token ids, each one's top-2 logprobs, cached prompt tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "logprobs": 2, "return_tokens_as_token_ids": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    ttft, tokens, tops, cached = None, [], [], None
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                if ttft is None:
                    ttft = time.perf_counter() - started
                lp = choice.get("logprobs") or {}
                tokens += [int(t.split(":")[-1]) for t in lp.get("tokens") or []]
                tops += [sorted(top.values(), reverse=True) for top in lp.get("top_logprobs") or [] if top]
            usage = chunk.get("usage")
            if usage:
                cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    return {"ttft_s": ttft, "tokens": tokens, "tops": tops, "cached_tokens": cached}


def compare(cold: dict, other: dict) -> dict:
    if other["tokens"] == cold["tokens"]:
        return {"tokens_equal": True, "first_divergence": None, "top2_gap": None}
    i = next((k for k, (a, b) in enumerate(zip(cold["tokens"], other["tokens"])) if a != b),
             min(len(cold["tokens"]), len(other["tokens"])))
    top = cold["tops"][i] if i < len(cold["tops"]) else []
    return {"tokens_equal": False, "first_divergence": i, "top2_gap": (top[0] - top[1]) if len(top) > 1 else None}


def pinned_h2d() -> float:
    """Bytes/s of a pinned 1 GiB host->device copy (median of 5)."""
    import torch

    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del host, dev
    torch.cuda.empty_cache()
    return n / statistics.median(times)


def model_facts(model_dir: str) -> tuple[int, int]:
    """(KV bytes per token in bf16, vocabulary size) of a model directory."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 2, c["vocab_size"]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    started = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before {url} was ready")
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{url} not ready within {timeout_s:.0f} s")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def vllm_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                         text=True)
    return out.stdout.strip() or "unknown"


class Rows:
    def __init__(self, path: str) -> None:
        self.path = path
        self.rows = json.load(open(path)) if os.path.exists(path) else []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        with open(self.path, "w") as f:
            json.dump(self.rows, f, indent=1)
        print(json.dumps({k: v for k, v in row.items() if k not in ("tokens",)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("kvshare", "vllm-offloading"), default="kvshare")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--model-name", default="qwen3-8b")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768])
    p.add_argument("--prompts", type=int, default=2, help="prompts per length (the first is B's first request)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=135168)
    p.add_argument("--pool-size", default="40GiB")
    p.add_argument("--offloading-gib", type=float, default=40.0)
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--ready-timeout-s", type=float, default=400)
    p.add_argument("--replica-arg", action="append", default=[], help="kvshare up --replica-arg (repeatable)")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script with vLLM CPU (no bound)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the servers (finally)
    os.makedirs(args.out, exist_ok=True)
    rows = Rows(os.path.join(args.out, "rows.json"))
    version = vllm_version()
    h2d = pinned_h2d() if args.device == "cuda" else float("nan")
    per_token, vocab = model_facts(args.model_dir)
    print(f"vLLM {version}; pinned H2D {h2d / 1e9:.1f} GB/s; KV {per_token} B/token", flush=True)
    env = dict(os.environ, VLLM_LOGGING_STREAM="ext://sys.stderr", VLLM_SERVER_DEV_MODE="1")
    log = open(os.path.join(args.out, f"{args.engine}.log"), "w")
    if args.engine == "kvshare":
        cmd = [sys.executable, "-m", "kvshare", "up", "--engine", "vllm", "--device", args.device, "--replicas", "2",
               "--model", args.model_dir, "--pool-size", args.pool_size, "--port", str(args.port),
               f"--replica-arg=--max-model-len={args.max_model_len}", *(f"--replica-arg={a}" for a in args.replica_arg)]
        urls = [f"http://127.0.0.1:{args.port + 1}", f"http://127.0.0.1:{args.port + 2}"]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model_dir,
               "--port", str(args.port + 1), "--served-model-name", args.model_dir, "--block-size", "32",
               "--max-model-len", str(args.max_model_len), "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
               "--kv-offloading-size", f"{args.offloading_gib:g}"]
        urls = [f"http://127.0.0.1:{args.port + 1}"]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        ready_s = max(wait_ready(u, proc, args.ready_timeout_s) for u in urls)
        print(f"ready in {ready_s:.0f} s", flush=True)
        model = args.model_dir
        rng = random.Random(0)
        lo = min(300, vocab // 10)  # clear of the special tokens at either end
        for i, u in enumerate(urls):  # warm-up: a short prompt of its own on each replica (no shared prefix)
            stream_completion(u, model, [rng.randrange(lo, vocab - lo) for _ in range(600)], 4, 300)
        first = True
        for length in args.lengths:
            for k in range(args.prompts):
                prompt = [rng.randrange(lo, vocab - lo) for _ in range(length)]
                row = {"model": args.model_name, "prompt_tokens": length, "vllm_version": version,
                       "engine": args.engine, "ready_s": round(ready_s, 1),
                       "h2d_gbps": round(h2d / 1e9, 2) if args.device == "cuda" else None}
                cold = stream_completion(urls[0], model, prompt, args.max_tokens, 900)
                if args.engine == "kvshare":
                    cross = stream_completion(urls[1], model, prompt, args.max_tokens, 900)
                    local = stream_completion(urls[0], model, prompt, args.max_tokens, 900)
                    loaded = (cross["cached_tokens"] or 0) * per_token
                    bound = loaded / h2d if args.device == "cuda" else None
                    row.update(cold_s=cold["ttft_s"], cross_s=cross["ttft_s"], local_s=local["ttft_s"],
                               bound_s=bound, cross_over_bound=cross["ttft_s"] / bound if bound else None,
                               cross_cached_tokens=cross["cached_tokens"], local_cached_tokens=local["cached_tokens"],
                               loaded_bytes=loaded, first_request=first, local_kind="vllm-gpu-prefix-cache",
                               **compare(cold, cross))
                else:
                    req = urllib.request.Request(urls[0] + "/reset_prefix_cache", data=b"", method="POST")
                    urllib.request.urlopen(req, timeout=60).read()
                    local = stream_completion(urls[0], model, prompt, args.max_tokens, 900)
                    row.update(cold_s=cold["ttft_s"], cross_s=None, local_s=local["ttft_s"],
                               local_cached_tokens=local["cached_tokens"], first_request=first,
                               local_kind="vllm-cpu-offloading (same replica, GPU prefix cache reset)",
                               bound_s=(local["cached_tokens"] or 0) * per_token / h2d if h2d == h2d else None,
                               **compare(cold, local))
                first = False
                rows.add(row)
    finally:
        stop(proc)
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
