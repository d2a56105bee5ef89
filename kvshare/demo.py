"""``kvshare demo``: the embedded default, on CPU, in a few minutes.

1. The pool: a pool daemon and two client processes; one stores pages, the other,
   which never saw them, finds and reads them byte for byte; the pool benchmark.
2. The system: ``kvshare up`` with the tiny model, or ``--model`` (qwen3.5-tiny: the hybrid, whose replicas share
   the GDN state's checkpoints beside the KV), (pool, two replicas, router), then
   the study's experiments at small scale through HTTP: cold vs local vs cross-replica
   time to first token, the OFF-ON-ON-OFF blocks, and six-turn sessions with
   alternating vs sticky placement, pool on and off. Tables are printed and a report
   (markdown, CSV/JSON of every request, plots) is written to ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os

import numpy as np

PAGE_BYTES = 2 << 20
NUM_PAGES = 16
NAMESPACE = hashlib.blake2b(b"kvshare-demo", digest_size=16).digest()


def _keys() -> list[bytes]:
    from kvshare.keys import chunk_keys

    tokens = list(range(NUM_PAGES * 256))  # a 4096-token "prompt": 16 chunks
    return chunk_keys(NAMESPACE, tokens)


def _store(socket_path: str) -> str:
    from kvshare.pool.checksum import page_checksum
    from kvshare.pool.client import PoolClient

    data = np.random.default_rng(7).integers(0, 255, (NUM_PAGES, PAGE_BYTES), dtype=np.uint8)
    with PoolClient(socket_path, name="demo-writer") as client:
        res = client.reserve(NAMESPACE, _keys(), PAGE_BYTES)
        sums = []
        for i, offset in res.grants:
            client.page(offset, PAGE_BYTES)[:] = data[i]
            sums.append(page_checksum(client.page(offset, PAGE_BYTES)))
        client.commit(res.reservation_id, sums)
    return hashlib.sha256(data.tobytes()).hexdigest()


def _load(socket_path: str) -> tuple[int, str]:
    from kvshare.pool.client import PoolClient

    with PoolClient(socket_path, name="demo-reader", verify_checksums=True) as client:
        lease = client.lookup(_keys(), PAGE_BYTES)
        digest = hashlib.sha256(b"".join(client.read_checked(h).tobytes() for h in lease.pages)).hexdigest()
        client.release([lease.lease_id], wait=True)
        return lease.num_pages, digest


def run_demo(args: argparse.Namespace) -> int:
    import shutil

    from rich.console import Console
    from rich.table import Table

    from kvshare.bench.demo_experiments import run_demo_experiments
    from kvshare.bench.pool_bench import PoolBenchConfig, run_pool_bench, summary_rows
    from kvshare.launch import Cluster, ClusterConfig
    from kvshare.pool.spawn import running_pool
    from kvshare.preflight import check_ports_free

    config = ClusterConfig(
        num_replicas=args.replicas, model=args.model, pool_size="4GiB", policy="alternate", port=args.port
    )
    # the cluster's ports before the pool's minute of benchmarks, not after it
    check_ports_free(
        config.host,
        {config.port: "the router", **{config.port + 1 + i: f"replica{i}" for i in range(config.num_replicas)}},
    )
    console = Console()
    os.makedirs(args.out, exist_ok=True)
    console.rule("1. the shared pool")
    with running_pool("1GiB", quiet=True) as socket_path:
        ctx = mp.get_context("spawn")
        with ctx.Pool(1) as writer_proc:
            stored = writer_proc.apply(_store, (socket_path,))
        with ctx.Pool(1) as reader_proc:
            found, loaded = reader_proc.apply(_load, (socket_path,))
        console.print(f"process A stored {NUM_PAGES} pages of {PAGE_BYTES >> 20} MiB (a 4096-token prefix)")
        console.print(f"process B found {found}/{NUM_PAGES} pages; bytes identical: {stored == loaded}")
        with console.status("measuring the pool (kvshare bench pool)..."):
            result = run_pool_bench(PoolBenchConfig(socket_path=socket_path))
    table = Table(title="kvshare bench pool")
    for col in ("measure", "figure", "against"):
        table.add_column(col)
    for row in summary_rows(result):
        table.add_row(*row)
    console.print(table)
    with open(os.path.join(args.out, "pool_bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    pool_ok = stored == loaded and found == NUM_PAGES

    console.rule(f"2. kvshare up: pool + {args.replicas} replicas + router, {args.model} on CPU")
    bench_dir = os.path.join(args.out, "bench")
    shutil.rmtree(bench_dir, ignore_errors=True)  # a demo run starts fresh (kvshare bench resumes instead)
    cluster = Cluster(config)
    with console.status("starting the cluster...") as status:
        cluster.start(progress=lambda msg: status.update(msg))
    try:
        console.print(f"router {cluster.router_url}; replicas {', '.join(cluster.replica_urls)}")
        outcome = run_demo_experiments(cluster, bench_dir, scale=args.scale, console=console)
    finally:
        cluster.stop()
    console.print(f"report: {outcome.report_path}")
    return 0 if pool_ok and outcome.is_complete else 1
