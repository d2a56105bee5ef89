"""The setups of benchmarks/vllm_gpu.py: what a run starts (vLLM servers, a pool, `kvshare up`, LMCache's server)
and the state every mode reads (``Run``). Not run by itself: vllm_gpu.py imports it.

Every vLLM command line comes from kvshare.integrations.vllm.launch, `kvshare up` included. A setup is a context
manager that yields once its servers serve (``run.urls``: the replicas A, B; ``run.router``) and stops them after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_gpu_client as client  # noqa: E402 (beside this file)

from kvshare.bench.records import tree_commit  # noqa: E402
from kvshare.children import stop_group  # noqa: E402
from kvshare.integrations.vllm.launch import (  # noqa: E402
    VllmServerConfig,
    hybrid_settings,
    vllm_server_command,
    wait_until_ready,
)
from kvshare.placement import VLLM_GPU_MEMORY_UTILIZATION  # noqa: E402


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


def vllm_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


class Rows:
    """OUT/rows.json, rewritten after every row (a run cut by a time limit keeps what it took)."""

    def __init__(self, path: str, common: dict) -> None:
        self.path = path
        self.common = common
        self.rows = json.load(open(path)) if os.path.exists(path) else []

    def add(self, row: dict) -> None:
        self.rows.append({**row, **self.common})
        with open(self.path, "w") as f:
            json.dump(self.rows, f, indent=1)
        print(json.dumps(row), flush=True)


class Run:
    """What every mode reads: the arguments, the model's facts, the servers' URLs, where rows go."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.version = vllm_version()
        self.h2d = pinned_h2d() if args.device == "cuda" else None
        self.per_token, self.vocab = model_facts(args.model_dir)
        self.rows = Rows(
            os.path.join(args.out, "rows.json"), {"setup": args.setup, "device": args.device, "commit": tree_commit()}
        )
        self.rng = random.Random(args.seed)
        self.urls: list[str] = []  # replicas: A, B
        self.router: str | None = None
        self.served = args.model_dir  # vLLM's model name: --model as given
        self.log_path = os.path.join(args.out, f"{args.setup}.log")
        self.first = True  # the next cross request is B's first
        print(
            f"vLLM {self.version}; pinned H2D {(self.h2d or 0) / 1e9:.1f} GB/s; KV {self.per_token} B/token", flush=True
        )

    def prompt(self, length: int) -> list[int]:
        lo = min(300, self.vocab // 10)  # clear of the special tokens at either end
        return [self.rng.randrange(lo, self.vocab - lo) for _ in range(length)]

    def complete(self, url: str, prompt: list[int], max_tokens: int | None = None, **extra) -> client.Completion:
        return client.stream_completion(
            url, self.served, prompt, max_tokens or self.args.max_tokens, 900, extra=extra or None
        )

    def base_row(self) -> dict:
        return {"model": self.args.model_name, "vllm_version": self.version}


def env_for_servers(args: argparse.Namespace) -> dict:
    env = dict(os.environ, VLLM_LOGGING_STREAM="ext://sys.stderr", VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
    if args.batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    return env


def start(argv: list[str], env: dict, log) -> subprocess.Popen:
    print("$ " + " ".join(argv), flush=True)
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def server_config(run: Run, port: int, replica: str, **fields) -> VllmServerConfig:
    """One vLLM replica of this run, as kvshare.integrations.vllm.launch builds every vLLM command; a hybrid model
    gets what its GDN state needs (launch.hybrid_settings: vLLM's block size as block, chunk and step, align mode),
    as `kvshare up` gives it, whichever KV tier the replica uses."""
    a = run.args
    hybrid = hybrid_settings(a.model_dir, a.device)
    if hybrid is not None:
        fields = dict(
            block_size=hybrid.block_size,
            chunk_tokens=hybrid.chunk_tokens,
            max_num_batched_tokens=hybrid.max_num_batched_tokens,
            mamba_cache_mode=hybrid.mamba_cache_mode,
            **fields,
        )
    gpu_share, shares_gpu = None, fields.pop("shares_gpu", False)
    if a.device == "cuda" and shares_gpu:
        # vLLM's share of one replica split, as `kvshare up` splits it; with --kv-cache-memory-bytes vLLM still
        # refuses to start unless this share of the card is free
        gpu_share = VLLM_GPU_MEMORY_UTILIZATION / 2
    return VllmServerConfig(
        model=a.model_dir,
        port=port,
        python=sys.executable,
        served_model_name=run.served,
        replica=replica,
        max_model_len=a.max_model_len,
        device=a.device,
        gpu_memory_utilization=gpu_share,
        load_format=a.load_format,
        model_revision=a.model_revision,
        extra_args=tuple(replica_args(a)),
        **fields,
    )


def replica_args(a: argparse.Namespace) -> list[str]:
    extra = list(a.replica_arg)
    if a.kv_cache_memory_bytes:
        extra.append(f"--kv-cache-memory-bytes={a.kv_cache_memory_bytes}")
    return extra


@contextlib.contextmanager
def servers(run: Run, configs: list[VllmServerConfig], env: dict, log, together: bool):
    """Start vLLM servers (one after the other unless ``together``: replicas sharing a GPU must not size their KV
    while another loads), yield when all are ready, stop them after."""
    procs = []
    try:
        for config in configs:
            spec = vllm_server_command(config, env)
            procs.append((start(spec.argv, spec.env, log), spec))
            if not together:
                wait_until_ready(spec.base_url, procs[-1][0], run.args.ready_timeout_s)
        for proc, spec in procs:
            wait_until_ready(spec.base_url, proc, run.args.ready_timeout_s)
        yield [spec.base_url for _, spec in procs]
    finally:
        for proc, _ in procs:
            stop_group(proc)


@contextlib.contextmanager
def pool(run: Run, log):
    from kvshare.pool.spawn import start_pool, stop_process

    with tempfile.TemporaryDirectory(prefix="kvshare-gpu-bench-") as tmp:
        proc = start_pool(os.path.join(tmp, "pool.sock"), run.args.pool_size, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield os.path.join(tmp, "pool.sock")
        finally:
            stop_process(proc, timeout_s=30)


@contextlib.contextmanager
def kvshare_up(run: Run, env: dict, log, pool_on: bool):
    """`kvshare up --engine vllm`: two replicas and the router (--policy; alternate: turn k of a session on replica
    k mod 2), sending prefix hints unless --hints off."""
    from kvshare.launch import wait_http_ready

    a = run.args
    cmd = [
        sys.executable,
        "-m",
        "kvshare",
        "up",
        "--engine",
        "vllm",
        "--device",
        a.device,
        "--replicas",
        "2",
        "--model",
        a.model_dir,
        "--port",
        str(a.port),
        "--policy",
        a.policy,
        *(["--no-hints"] if a.hints == "off" else []),
        *(["--pool-size", a.pool_size] if pool_on else ["--pool", "off"]),
        f"--replica-arg=--max-model-len={a.max_model_len}",
        *(f"--replica-arg={x}" for x in replica_args(a)),
        *(["--model-revision", a.model_revision] if a.model_revision else []),
    ]
    proc = start(cmd, env, log)
    try:
        run.urls = [f"http://127.0.0.1:{a.port + 1}", f"http://127.0.0.1:{a.port + 2}"]
        run.router = f"http://127.0.0.1:{a.port}"
        for url in run.urls:
            wait_until_ready(url, proc, a.ready_timeout_s * 2)
        wait_http_ready(run.router, proc, a.ready_timeout_s, "the router")
        yield
    finally:
        stop_group(proc)


@contextlib.contextmanager
def lmcache_server(run: Run, env: dict, log):
    """LMCache's multi-process server (a CPU KV pool the replicas share), ready when it says it runs."""
    a = run.args
    argv = [
        sys.executable,
        "-m",
        "lmcache.v1.multiprocess.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(a.lmcache_port),
        "--l1-size-gb",
        f"{a.lmcache_l1_gb:g}",
        "--eviction-policy",
        "LRU",
        *a.lmcache_server_arg,
    ]
    server_log = os.path.join(a.out, "lmcache-server.log")
    with open(server_log, "w") as own:
        proc = start(argv, dict(env, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1"), own)
    try:
        deadline = time.monotonic() + 120
        while "cache server is running" not in open(server_log, errors="replace").read():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the LMCache server did not start (see {server_log})")
            time.sleep(1)
        yield
    finally:
        stop_group(proc)


@contextlib.contextmanager
def setup(run: Run, env: dict, log):
    """Start what ``--setup`` names; yield once it serves; stop it after."""
    a = run.args
    two = a.device == "cpu" or bool(a.kv_cache_memory_bytes)  # may start together
    if a.setup in ("kvshare", "kvshare-pool-off"):
        with kvshare_up(run, env, log, pool_on=a.setup == "kvshare"):
            yield
    elif a.setup == "vllm-offloading":
        config = server_config(run, a.port + 1, "A", kv_offloading_gib=a.offloading_gib)
        with servers(run, [config], env, log, True) as run.urls:
            yield
    elif a.setup == "lmcache-mp":
        with lmcache_server(run, env, log):
            configs = [
                server_config(run, a.port + 1 + i, name, lmcache_mp_port=a.lmcache_port, shares_gpu=True)
                for i, name in enumerate("AB")
            ]
            with servers(run, configs, env, log, two) as run.urls:
                yield
    elif a.setup == "store-cost":
        with pool(run, log) as socket_path:
            configs = [
                server_config(run, a.port + 1, "A", pool_socket=socket_path, shares_gpu=True),
                server_config(run, a.port + 2, "R", shares_gpu=True),
            ]
            with servers(run, configs, env, log, two) as run.urls:
                yield
