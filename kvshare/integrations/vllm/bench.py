"""TTFT of vLLM with kvshare's connector: cold, vLLM's own prefix-cache hit, and cross-replica.

    python -m kvshare.integrations.vllm.bench --vllm-python /tmp/vllm-venv/bin/python \\
        --lengths 8192 16384 --repeats 3 --out results/vllm

starts a pool and three vLLM OpenAI servers on the tiny preset (A and B with the
connector, R without it) and, per length and repeat, with a fresh random prompt:

    cold (R)     plain vLLM computes the prompt
    cold (A)     A computes it and stores its chunks into the pool (the store is in its TTFT)
    local (A)    the same prompt again on A: vLLM's own prefix cache
    local (R)    the same on plain vLLM
    cross (B)    B has never seen it: its prefix comes from the pool
    local (B)    the same prompt again on B: vLLM's own prefix cache, after the load

Each request starts ``--settle-s`` after the previous one ended: after a step, vLLM's engine
core and worker busy-poll their shared-memory queues for 1 s (sched_yield), and on a 2-core
machine that slowed whichever server was measured next (cross (B) came right after local (R)).

``--timings`` runs A and B with the connector's debug log on and reports the median of each
phase of their loads, stores, lookups and steps (``kvshare timing:`` lines of the servers' logs).
``--copy-only`` measures only the connector's store and load of one prompt (vLLM-CPU-shaped
tensors of the tiny preset, no vLLM). TTFT is the time to the first streamed token of a completion;
usage.prompt_tokens_details.cached_tokens of each request is kept with it. It prints a markdown
table (medians) and the connector's load/store bandwidth from the servers' /metrics,
and writes every measurement to OUT/ttft.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from kvshare.integrations.vllm.bench_copy import copy_bandwidth
from kvshare.integrations.vllm.bench_timings import parse_timings, timing_report
from kvshare.integrations.vllm.launch import VllmServerConfig, vllm_server_command, wait_until_ready
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.pool.spawn import kvshare_command, kvshare_env, start_pool, stop_process


def first_token_seconds(base_url: str, model: str, prompt: list[int], timeout_s: float = 600) -> tuple[float, int]:
    """Seconds to the first streamed completion token, and the prompt tokens vLLM reported as cached."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    ttft, cached = None, -1
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - started
            usage = event.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached) if usage else cached
    if ttft is None:
        raise RuntimeError(f"{base_url} streamed no token")
    return ttft, cached


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:kvshare_"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def run(args: argparse.Namespace) -> dict:
    """Start the pool and the servers, measure every length and repeat, stop them; the result with its settings."""
    load_before = os.getloadavg()[0]
    work = tempfile.mkdtemp(prefix="kvshare-vllm-bench-")
    model = args.model or _make_tiny_model(os.path.join(work, "model"))
    socket_path = os.path.join(work, "pool.sock")
    pool = start_pool(socket_path, args.pool_size, ("--prefault",), stdout=subprocess.DEVNULL)
    procs = {}
    try:
        for name, config in _server_configs(args, model, socket_path).items():
            spec = vllm_server_command(config)
            log = open(os.path.join(work, f"vllm-{name}.log"), "w")
            procs[name] = (
                subprocess.Popen(spec.argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                spec,
            )
        for proc, spec in procs.values():
            wait_until_ready(spec.base_url, proc, timeout_s=600)
        url = {name: spec.base_url for name, (_, spec) in procs.items()}
        rows = _measure(args, url, os.path.basename(os.path.normpath(model)))
        time.sleep(12)  # vLLM publishes connector stats to /metrics at its logging interval
        counters = {name: metrics(url[name]) for name in ("A", "B")}
        timings = {}
        for name in ("A", "B") if args.timings else ():
            with open(os.path.join(work, f"vllm-{name}.log"), errors="replace") as f:
                timings[name] = parse_timings(f.read())
    finally:
        _stop(procs, pool)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            for name in procs:
                shutil.copy(os.path.join(work, f"vllm-{name}.log"), args.out)
        shutil.rmtree(work, ignore_errors=True)
    return {"rows": rows, "counters": counters, "timings": timings, **_settings(args, load_before)}


def _make_tiny_model(path: str) -> str:
    subprocess.run(
        [*kvshare_command("WARNING"), "make-model", "tiny", "--out", path],
        check=True,
        stdout=subprocess.DEVNULL,
        env=kvshare_env(),
    )
    return path


def _server_configs(args: argparse.Namespace, model: str, socket_path: str) -> dict[str, VllmServerConfig]:
    """A and B with the connector (its settings from the arguments; None: the connector's default), R without."""
    common = dict(
        model=model,
        python=args.vllm_python,
        dtype="float32",
        kv_cache_gib=args.kv_cache_gib,
        max_model_len=max(args.lengths) + 64,
        cpu_omp_threads_bind=args.omp_bind or None,
        verify_fraction=args.verify_fraction,
        overlap_load={"on": True, "off": False}.get(args.overlap_load),
        copy_threads=args.copy_threads,
    )
    log_level = "DEBUG" if args.timings else None
    return {
        "A": VllmServerConfig(port=free_port(), pool_socket=socket_path, replica="A", log_level=log_level, **common),
        "B": VllmServerConfig(port=free_port(), pool_socket=socket_path, replica="B", log_level=log_level, **common),
        "R": VllmServerConfig(port=free_port(), pool_socket=None, replica="R", **common),
    }


def _measure(args: argparse.Namespace, url: dict[str, str], served: str) -> list[dict]:
    """Per length and repeat, a fresh random prompt through the six requests, in their order."""
    rng = random.Random(args.seed)
    for name in url:  # warm-up: the first request of a server pays one-time costs
        first_token_seconds(url[name], served, [rng.randrange(256) for _ in range(300)])
    rows = []
    for length in args.lengths:
        for repeat in range(args.repeats):
            prompt = [rng.randrange(256) for _ in range(length)]
            row = {"length": length, "repeat": repeat}
            for label, name in (
                ("cold_R", "R"),
                ("cold_A", "A"),
                ("local_A", "A"),
                ("local_R", "R"),
                ("cross_B", "B"),
                ("local_B", "B"),
            ):
                time.sleep(args.settle_s)
                row[label], row[f"{label}_cached"] = first_token_seconds(url[name], served, prompt)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _stop(procs: dict, pool) -> None:
    """The servers (their process groups: SIGTERM, SIGKILL after a minute), then the pool."""
    for proc, _ in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
    for proc, _ in procs.values():
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
    stop_process(pool)


def _settings(args: argparse.Namespace, load_before: float) -> dict:
    """What the run measured with, the connector's defaults filled in."""
    defaults = ConnectorConfig()
    return {
        "verify_fraction": args.verify_fraction if args.verify_fraction is not None else defaults.verify_fraction,
        "overlap_load": args.overlap_load != "off" if args.overlap_load else defaults.overlap_load,
        "copy_threads": args.copy_threads or defaults.copy_threads,
        "settle_s": args.settle_s,
        "lengths": args.lengths,
        "repeats": args.repeats,
        "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "omp_bind": args.omp_bind,
        "machine": f"{os.cpu_count()} CPUs",
        "model": "tiny preset (kvshare make-model tiny)",
    }


def summary(result: dict) -> list[dict]:
    """Per length: cross-replica TTFT (B) over the connector replica's own local hit (A), medians and minima
    of the run, with the absolute figures beside them (the target: <= 1.5x at 8k and 16k)."""
    out = []
    for length in result["lengths"]:
        rows = [r for r in result["rows"] if r["length"] == length]
        if not rows:
            continue
        cross, local = statistics.median(r["cross_B"] for r in rows), statistics.median(r["local_A"] for r in rows)
        out.append(
            {
                "length": length,
                "cross_over_local_hit": cross / local,
                "cross_over_local_hit_min": min(r["cross_B"] for r in rows) / min(r["local_A"] for r in rows),
                "cross_s": cross,
                "local_hit_s": local,
                "cold_s": statistics.median(r["cold_R"] for r in rows),
                "repeats": len(rows),
                "cached_tokens_on_b": sorted({r["cross_B_cached"] for r in rows}),
            }
        )
    return out


def report(result: dict) -> str:
    """Medians, and minima: on a shared machine other work only ever adds time, so the minimum
    is the figure least disturbed by it."""
    lines = [
        "| prompt tokens | statistic | cold, plain vLLM | cold, A (stores) | local hit, A | local hit, plain vLLM "
        "| cross-replica, B | local hit, B (after its load) | cross (B) / local hit (A) | cached tokens on B |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    keys = ("cold_R", "cold_A", "local_A", "local_R", "cross_B", "local_B")
    for length in result["lengths"]:
        rows = [r for r in result["rows"] if r["length"] == length]
        cached = ", ".join(map(str, sorted({r["cross_B_cached"] for r in rows})))
        for name, stat in (("median", statistics.median), ("min", min)):
            v = {k: stat(r[k] for r in rows) if all(k in r for r in rows) else None for k in keys}
            local_b = f"{v['local_B']:.3f} s" if v["local_B"] is not None else "n/a"  # not measured before 2026-12-01
            lines.append(
                f"| {length} | {name} of {len(rows)} | {v['cold_R']:.3f} s | {v['cold_A']:.3f} s | "
                f"{v['local_A']:.3f} s | {v['local_R']:.3f} s | {v['cross_B']:.3f} s | {local_b} | "
                f"{v['cross_B'] / v['local_A']:.2f}x | {cached} |"
            )
    a, b = result["counters"]["A"], result["counters"]["B"]

    def rate(c, what):
        seconds = c.get(f"vllm:kvshare_{what}_seconds_total", 0.0)
        num_bytes = c.get(f"vllm:kvshare_{what}_bytes_total", 0.0)
        if not seconds:
            return "n/a"
        return f"{num_bytes / seconds / 1e9:.2f} GB/s ({num_bytes / 2**20:.0f} MiB in {seconds:.3f} s)"

    overlap = {True: ", copied layer by layer beside the forward", False: ", before the forward"}.get(
        result.get("overlap_load"), ""
    )
    lines += [
        "",
        f"requests {result.get('settle_s', 0)} s apart (vLLM's queues busy-poll for 1 s after a step)",
        f"load (B, checksums of {result.get('verify_fraction', 1.0):.0%} of pages verified{overlap}): "
        f"{rate(b, 'load')}; "
        f"store (A, with checksums): {rate(a, 'store')}",
        f"load average before / after: {result['loadavg'][0]} / {result['loadavg'][1]} ({result['machine']})",
    ]
    if result.get("timings"):
        lines += timing_report(result["timings"])
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="python of the vLLM virtual environment")
    parser.add_argument("--model", default=None, help="model directory (default: the tiny preset)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool-size", default="2GiB")
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument(
        "--omp-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND for the servers (default: vLLM's own, auto)"
    )
    parser.add_argument(
        "--overlap-load",
        choices=("on", "off"),
        default=None,
        help="copy loads layer by layer beside the forward (default: the connector's, off)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=1.5,
        help="pause before each measured request: after a step, vLLM's engine and worker processes "
        "busy-poll their queues for 1 s, which on a small machine slows whichever server "
        "is measured next (default 1.5)",
    )
    parser.add_argument(
        "--copy-threads",
        type=int,
        default=None,
        help="threads of the connector's CPU copies in A and B (default: the connector's, 2)",
    )
    parser.add_argument(
        "--verify-fraction",
        type=float,
        default=None,
        help="share of loaded pages whose checksum A and B check (default: the connector's, 1.0)",
    )
    parser.add_argument(
        "--timings",
        action="store_true",
        help="log the connector's phase timings in A and B (debug log) and report their medians",
    )
    parser.add_argument(
        "--copy-only",
        action="store_true",
        help="only the connector's copies (no vLLM): store and load one prompt per length",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="folder for ttft.json and ttft.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.copy_only:
        for length in args.lengths:
            print(json.dumps(copy_bandwidth(length)))
        return 0
    result = run(args)
    result["summary"] = summary(result)
    text = report(result)
    print(text)
    for line in result["summary"]:
        print(json.dumps(line), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ttft.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "ttft.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
