#!/usr/bin/env python3
"""The headline table: kvshare (``kvshare up``, 2 replicas, built-in engine) against vLLM (1 replica, its native
CPU offloading) on one machine, the same model directory, the same client and the same prompts.

Per prompt length, ``--prompts`` fresh random token-id prompts (the first is replica B's first request of its
cluster, the rest the steady state). kvshare first, then vLLM, never both at once:

    kvshare  A cold  ->  B cross-replica (B never saw it: the prefix comes from the pool)  ->  A again (GPU hit)
    vLLM     cold    ->  again (its GPU prefix cache)  ->  prefix cache reset, again (a hit from its CPU tier)

TTFT is the time to the first streamed token (kvshare.bench.client, max_tokens 16, temperature 0). The bound is
the cross request's KV bytes (pool tokens x KV bytes per token) over the host->device rate measured in this run:
pinned H2D on CUDA; on CPU a pool load is a host memcpy, so the bound there is a 512 MiB memcpy's rate (say so).
vLLM's native CPU offloading runs only on GPUs (vLLM 0.32 CPU refuses it), so a CPU run has no CPU-tier column.

Clients (``--client``, repeatable): ``token_ids`` sends random ids to /v1/completions; ``text`` sends chat messages
that the model's chat template renders to exactly the prompt length, through the bench client's user mode
(``BenchRequest.is_user_client``: the openai SDK where installed, the body encoded inside the clock; refused where
the client lacks it). A text row's ``text_overhead`` is its cross-replica TTFT over that of the token-id prompt of
the same length and index, minus 1.

Rows (``rows.json``), the table and the exact command lines go to a folder named by date and commit
(``--out``, default ``docs/results/<date>-<commit>-vs-vllm``); each engine's logs to ``logs/`` there. Each
engine's figures are kept in ``measurements.json`` there as its phase ends: where one command cannot run both
within a time limit, ``--engines kvshare`` and then ``--engines vllm`` with the same ``--out`` make one table
(the prompts come from ``--seed``, so both phases send the same requests; every server starts empty).

    # the GPU machine (vLLM 0.26 from the bundle): benchmarks/vs_vllm.sh
    # CPU, the plumbing (vLLM CPU 0.32 in its venv):
    python benchmarks/vs_vllm.py --preset tiny --device cpu --lengths 512 1024 \\
        --vllm-python .venv-vllm/bin/python --label "plumbing run on 2 CPU cores"
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # up_cluster, service_ttft_gpu, vs_vllm_client and vs_vllm_rows beside this script
from vs_vllm_client import (  # noqa: E402
    chat_prompt,
    request,
    served_model,
    text_client_refusal,
    timelines,
    warm_client,
)
from vs_vllm_rows import (  # noqa: E402,F401 (ROW_FIELDS, readme: part of this script's interface)
    ROW_FIELDS,
    make_row,
    ratio,
    readme,
    result_dir_name,
    table,
    with_token_ids_twins,
)

CLIENTS = ("token_ids", "text")
ENGINES = ("kvshare", "vllm")
OFFLOADING_ON_CPU = (
    "vLLM's native CPU offloading runs only on GPUs (vLLM 0.32 CPU: 'CPU Offloading is "
    "currently only supported on CUDA-alike and XPU GPUs')"
)


# -- the run -----------------------------------------------------------------------------------------------


class Measurements:
    """Each engine's figures in OUT/measurements.json, written as its phase ends: a phase that another command
    of the same plan ran (``--engines``) completes the table; a file of another plan is refused."""

    def __init__(self, path: str, plan: dict) -> None:
        self.path = path
        self.data: dict = {"plan": plan, "commands": [], "phases": {}}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            if data.get("plan") != plan:
                raise SystemExit(
                    f"vs_vllm: {path} holds measurements of another plan ({data.get('plan')}); give another --out"
                )
            self.data = data

    def add_command(self, command: str) -> None:
        self.data["commands"].append(command)
        self._write()

    def commands(self) -> list[str]:
        return list(self.data["commands"])

    def put(self, phase: str, value: dict) -> None:
        self.data["phases"][phase] = value
        self._write()

    def get(self, phase: str) -> dict | None:
        return self.data["phases"].get(phase)

    def _write(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f)
        os.replace(self.path + ".tmp", self.path)


def memcpy_rate(num_bytes: int = 512 << 20) -> float:
    """Bytes/s of one host memcpy of ``num_bytes`` (best of 5): a CPU replica's pool load is such a copy."""
    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def run_kvshare(length: int, prompts: dict[str, list[list[int]]], args, model_dir: str) -> tuple[list[dict], list[str]]:
    """kvshare's measurements of one length's prompts per client on a fresh ``kvshare up`` (service_ttft_gpu's
    plan). B's first request of the cluster is the first client's first prompt."""
    from service_ttft_gpu import cluster_spec, plan_case
    from up_cluster import Cluster

    plan = plan_case(args.preset, length, args, args.gpu_bytes)
    if plan["layout"] is None:
        raise SystemExit(f"{args.preset} at {length} tokens: two replicas do not fit this GPU")
    served = args.preset if args.no_weights else model_dir  # the preset by name: its weights drawn on the device
    cluster = Cluster(replace(cluster_spec(plan, args), model=served, policy="round_robin"))
    out: list[dict] = []
    try:
        cluster.start()
        a, b = cluster.urls["A"], cluster.urls["B"]
        cluster.phase("A")
        model = served_model(a)
        got = {}
        for client, ids_list in prompts.items():
            warm_client(a, model, client, model_dir, args.seed, True)
            for k, ids in enumerate(ids_list):
                ask = functools.partial(request, model=model, prompt=ids, max_tokens=args.max_tokens, use_pool=True)
                ask = functools.partial(ask, client=client, timeline=args.timelines)
                cold = ask(a)
                cross = ask(b) if plan["layout"] == "together" else None
                local = [ask(a) for _ in range(args.local_repeats)]
                got[client, k] = [cold, cross, local]
        if plan["layout"] == "sequential":
            cluster.phase("B")
            for client, ids_list in prompts.items():
                for k, ids in enumerate(ids_list):
                    got[client, k][1] = request(b, model, ids, args.max_tokens, True, client, args.timelines)
        for i, ((client, k), (cold, cross, locals_)) in enumerate(got.items()):
            prov = cross.provenance or {}
            hits = [r.ttft_s for r in locals_ if (r.provenance or {}).get("local_tokens", 0) > 0]
            out.append(
                {
                    "prompt_tokens": length,
                    "prompt_index": k,
                    "client": client,
                    "first_request": i == 0,
                    "cold_s": cold.ttft_s,
                    "cross_s": cross.ttft_s,
                    "local_s": hits[0] if hits else None,
                    "local_max_s": max(hits) if len(hits) > 1 else None,
                    "local_hits_s": hits,
                    "local_misses": len(locals_) - len(hits),  # repeats the replica's own cache did not answer
                    **({"timelines": timelines(cold, cross, locals_)} if args.timelines else {}),
                    "pool_tokens": prov.get("pool_tokens"),
                    "tokens_equal": cross.token_ids == cold.token_ids,
                }
            )
    finally:
        cluster.stop()
    commands = [shlex.join(c) for c in cluster.commands.values()]
    return out, commands


def run_vllm(prompts: dict[tuple[int, str], list[list[int]]], args, model_dir: str) -> tuple[dict, str]:
    """vLLM's measurements per (length, client, prompt index): cold, GPU hit and (with offloading) CPU-tier hit."""
    from kvshare.children import stop_group
    from kvshare.integrations.vllm.launch import VllmServerConfig, vllm_server_command, wait_until_ready
    from kvshare.launch import free_port_block

    offloading = args.vllm_offloading_gib > 0 and args.device != "cpu"
    extra = ("--kv-offloading-size", f"{args.vllm_offloading_gib:g}") if offloading else ()
    extra += ("--load-format", "dummy") if args.no_weights else ()
    chunk = 256
    context = -(-(max(args.lengths) + args.max_tokens) // chunk) * chunk
    config = VllmServerConfig(
        model=model_dir,
        port=free_port_block(1),
        python=args.vllm_python,
        pool_socket=None,
        replica="vllm",
        max_model_len=context,
        device="cpu" if args.device == "cpu" else "cuda",
        dtype=args.model_dtype,
        kv_cache_gib=args.vllm_cpu_kv_gib,
        cpu_omp_threads_bind="nobind" if args.device == "cpu" else None,
        extra_args=extra,
    )
    spec = vllm_server_command(config)
    env = dict(spec.env, VLLM_SERVER_DEV_MODE="1")  # /reset_prefix_cache: the next hit comes from the CPU tier
    log = open(os.path.join(args.log_dir, "vllm.log"), "w")
    print("$ " + shlex.join(spec.argv), flush=True)
    proc = subprocess.Popen(spec.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out: dict = {}
    try:
        wait_until_ready(spec.base_url, proc, timeout_s=args.start_timeout)
        model = served_model(spec.base_url)
        rng = np.random.default_rng(args.seed + 1)  # a warm-up prompt that shares nothing with the measured ones
        request(spec.base_url, model, rng.integers(0, args.vocab, 300).tolist(), 4, None)
        for (length, client), ids_list in prompts.items():
            warm_client(spec.base_url, model, client, model_dir, args.seed, None)
            for k, ids in enumerate(ids_list):
                cold = request(spec.base_url, model, ids, args.max_tokens, None, client)
                local = request(spec.base_url, model, ids, args.max_tokens, None, client)
                tier = None
                if offloading:
                    reset = urllib.request.Request(spec.base_url + "/reset_prefix_cache", data=b"", method="POST")
                    urllib.request.urlopen(reset, timeout=60).read()
                    tier = request(spec.base_url, model, ids, args.max_tokens, None, client)
                out[length, client, k] = {
                    "cold_s": cold.ttft_s,
                    "local_s": local.ttft_s,
                    "cpu_tier_s": tier.ttft_s if tier else None,
                    "cached_tokens": (tier or local).cached_tokens,
                }
    finally:
        stop_group(proc)
        log.close()
    return out, shlex.join(spec.argv)


def vllm_version(python: str) -> str:
    done = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "")),
    )
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else "unknown"


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="qwen3-8b", help="kvshare make-model preset (tiny, qwen3-8b, qwen3-32b)")
    p.add_argument("--model-dir", default=None, help="where the preset is written (default /tmp/vs-vllm-PRESET)")
    p.add_argument(
        "--no-weights",
        action="store_true",
        help="write the preset's config and tokenizer only (the 32B shape's 65 GB of weights do not fit the GPU "
        "machine's disk): kvshare's replicas draw the preset's seeded weights on the device, vLLM its own "
        "(--load-format dummy); the values differ, the shapes and so the timings do not",
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--prompts", type=int, default=2, help="prompts per length (the first is B's first request)")
    p.add_argument(
        "--client",
        choices=CLIENTS,
        action="append",
        default=None,
        help="token_ids (default) and/or text (through /v1/chat/completions; repeatable)",
    )
    p.add_argument(
        "--engines",
        nargs="*",
        choices=ENGINES,
        default=list(ENGINES),
        help="the phases this command runs (default both); a phase measured by an earlier command with "
        "the same --out and plan is kept, so each engine may have a command of its own; none "
        "(--engines alone): the table and README again from the phases kept",
    )
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--vllm-python", default=sys.executable, help="the interpreter of vLLM's environment")
    p.add_argument("--vllm-offloading-gib", type=float, default=40.0, help="vLLM's --kv-offloading-size (0: off)")
    p.add_argument("--vllm-cpu-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE on CPU")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--timelines",
        action="store_true",
        help="ask kvshare's replicas for each request's timeline (its steps to the first token; measurements.json)",
    )
    p.add_argument(
        "--local-repeats", type=int, default=5, help="kvshare's local hit measured this many times per prompt"
    )
    p.add_argument("--verify-rate", type=float, default=1.0, help="kvshare replicas' --verify-rate (default: all)")
    p.add_argument("--replica-arg", action="append", default=[], help="more kvshare replica arguments")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="what this run is, in the README (e.g. a plumbing run on CPU)")
    p.add_argument("--out", default=None, help="result folder (default docs/results/<date>-<commit>-vs-vllm)")
    args = p.parse_args(argv)
    args.client = args.client or ["token_ids"]
    # what service_ttft_gpu's plan and cluster read
    args.layout, args.pool_size, args.local_cache_size, args.pool_arg = "auto", None, None, []
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "text" in args.client and (why := text_client_refusal()) is not None:
        print(f"vs_vllm: {why}", file=sys.stderr)
        return 2
    from service_ttft_gpu import measure_h2d

    from kvshare.bench.records import describe_host, tree_commit
    from kvshare.engine.config import model_config_from_hf
    from kvshare.engine.presets import PRESETS

    if args.preset not in PRESETS:
        print(f"vs_vllm: unknown preset {args.preset!r}; one of {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    context = PRESETS[args.preset].config.max_position_embeddings
    if too_long := [n for n in args.lengths if n + args.max_tokens > context]:
        print(
            f"vs_vllm: {args.preset}'s context is {context} tokens: a prompt of {too_long[0]} leaves no room for "
            f"{args.max_tokens} generated tokens (--lengths up to {context - args.max_tokens})",
            file=sys.stderr,
        )
        return 2
    load_before = os.getloadavg()[0]
    command = shlex.join(
        [
            "python",
            os.path.relpath(sys.argv[0], ROOT) if argv is None else "benchmarks/vs_vllm.py",
            *(sys.argv[1:] if argv is None else argv),
        ]
    )
    date, commit = datetime.date.today().isoformat(), tree_commit() or "unknown"
    out = args.out or os.path.join(ROOT, "docs", "results", result_dir_name(date, commit))
    args.log_dir = os.path.join(out, "logs")
    os.makedirs(args.log_dir, exist_ok=True)
    model_dir = args.model_dir or f"/tmp/vs-vllm-{args.preset}"
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        subprocess.run(
            [sys.executable, "-m", "kvshare", "make-model", args.preset, "--out", model_dir, "--device", args.device]
            + (["--no-weights"] if args.no_weights else []),
            check=True,
        )
    with open(os.path.join(model_dir, "config.json")) as f:
        mc = model_config_from_hf(json.load(f))
    args.model_dtype, args.vocab = mc.dtype, min(mc.vocab_size, 256 if args.preset == "tiny" else 150000)
    # the same seed, the same prompts: a phase run by another command (--engines) measures the same requests, and
    # every server starts empty (a fresh pool and replicas, a fresh vLLM), so nothing is cached from earlier runs
    rng = np.random.default_rng(args.seed)
    # a prompt per (length, client, index): a text prompt never meets the KV of its token-id twin
    prompts = {
        (n, c): [
            rng.integers(0, args.vocab, n).tolist()
            if c == "token_ids"
            else chat_prompt(model_dir, args.seed, n, f"vs-vllm/{n}/{k}")
            for k in range(args.prompts)
        ]
        for n in args.lengths
        for c in args.client
    }
    plan = {
        "preset": args.preset,
        "no_weights": args.no_weights,
        "device": args.device,
        "lengths": args.lengths,
        "clients": args.client,
        "prompts": args.prompts,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
    }
    saved = Measurements(os.path.join(out, "measurements.json"), plan)
    if args.engines:  # none: only the table again, from the phases kept
        saved.add_command(command)
    if "kvshare" in args.engines:
        if args.device == "cpu":
            rate, bound_kind, args.gpu_bytes = memcpy_rate(), "host-memcpy", 0
            bound_note = f"KV bytes / a host memcpy's rate ({rate / 1e9:.1f} GB/s, measured here): a CPU replica's load"
        else:
            rate, measured, args.gpu_bytes = measure_h2d("cuda")
            bound_kind = "pinned-h2d" if measured else "pinned-h2d-assumed"
            how = "measured in the kvshare phase" if measured else "assumed: the copy failed"
            bound_note = f"KV bytes / pinned host->device ({rate / 1e9:.1f} GB/s, {how})"
        print(f"bound rate {rate / 1e9:.1f} GB/s ({bound_kind})", flush=True)
        figures, commands = [], []
        for length in args.lengths:
            got, started = run_kvshare(length, {c: prompts[length, c] for c in args.client}, args, model_dir)
            figures += with_token_ids_twins(got)
            commands += [c for c in started if c not in commands]
        saved.put(
            "kvshare",
            {
                "figures": figures,
                "commands": commands,
                "bound_rate": rate,
                "bound_kind": bound_kind,
                "loadavg": f"{load_before:.1f} / {os.getloadavg()[0]:.1f}",
                "bound_note": bound_note,
                "hardware": describe_host(args.device),
                "commit": commit,
            },
        )
    if "vllm" in args.engines:
        load_before = os.getloadavg()[0]
        version = vllm_version(args.vllm_python)
        vl, vllm_command = run_vllm(prompts, args, model_dir)
        saved.put(
            "vllm",
            {
                "figures": [{"prompt_tokens": n, "client": c, "prompt_index": k, **v} for (n, c, k), v in vl.items()],
                "command": vllm_command,
                "version": version,
                "commit": commit,
                "loadavg": f"{load_before:.1f} / {os.getloadavg()[0]:.1f}",
            },
        )
    kv, vllm = saved.get("kvshare"), saved.get("vllm")
    if kv is None:
        print(f"measured vLLM only; the table waits for the kvshare phase (--engines kvshare --out {out})", flush=True)
        return 0
    vl = {(f["prompt_tokens"], f["client"], f["prompt_index"]): f for f in (vllm or {}).get("figures", [])}
    rate, bound_kind, bound_note = kv["bound_rate"], kv["bound_kind"], kv["bound_note"]
    version = vllm["version"] if vllm else None
    commit = kv["commit"] if vllm is None or vllm["commit"] == kv["commit"] else f"{kv['commit']}+{vllm['commit']}"
    command = "\n".join(saved.commands())  # one line each
    engine_commands = kv["commands"] + ([vllm["command"]] if vllm else [])
    common = {
        "model": args.preset,
        "bound_kind": bound_kind,
        "vllm_version": version,
        "commit": commit,
        "command": command,
        "hardware": kv["hardware"],
    }
    rows = [
        make_row(common, r, vl.get((r["prompt_tokens"], r["client"], r["prompt_index"])), rate, mc.kv_bytes_per_token)
        for r in kv["figures"]
    ]
    tier = f"--kv-offloading-size {args.vllm_offloading_gib:g}" if args.device != "cpu" else "no CPU tier"
    notes = [
        "kvshare: `kvshare up` with its defaults (2 replicas, built-in engine, every loaded page verified), "
        "the replica arguments of service_ttft_gpu's plan (a prompt's KV fits the local cache)"
        + "".join(f", {a}" for a in args.replica_arg)
        + f"; vLLM: one replica, prefix caching on, {tier}."
    ]
    if args.no_weights:
        notes.append(
            "Weights: random, drawn by each engine on the GPU (kvshare: the preset's seeded ones; vLLM: "
            "--load-format dummy): the same shapes, other values, so the timings compare and the tokens do not."
        )
    if vllm is None:
        notes.append("vLLM was not measured (its columns are empty): run this command with --engines vllm.")
    if "text" in args.client:
        notes.append(
            "Text: before each server's first text prompt, one short chat request through the same client "
            "(vs_vllm.warm_client): the openai SDK's first call in a process pays its set-up inside the clock."
        )
    if args.device == "cpu":
        notes.append(OFFLOADING_ON_CPU + ": the vLLM CPU-tier column is empty.")
        notes.append("On CPU the local hits are each engine's own prefix cache in host memory.")
    meta = {
        "date": date,
        "commit": commit,
        "label": args.label,
        "hardware": common["hardware"],
        "vllm_version": version,
        "vllm_python": args.vllm_python,
        "model": args.preset,
        "model_dir": model_dir,
        "bound_note": bound_note,
        "loadavg": "; ".join(
            f"{p} {saved.get(p)['loadavg']}" for p in ENGINES if saved.get(p) and "loadavg" in saved.get(p)
        ),
        "command": command,
        "engine_commands": engine_commands,
        "notes": notes,
    }
    with open(os.path.join(out, "rows.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(readme(rows, meta))
    print(table(rows), flush=True)
    print(f"written: {out}", flush=True)
    return 0 if all(r["tokens_equal"] for r in rows) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the servers (finally)
    sys.exit(main())
