"""``kvshare demo``: the embedded default, showing what the system can do so far.

Stage 1 (the pool): a pool daemon and two client processes; one stores pages,
the other, which never saw them, finds and reads them byte for byte; then the
pool benchmark's figures.
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
    from rich.console import Console
    from rich.table import Table

    from kvshare.bench.pool_bench import PoolBenchConfig, run_pool_bench, summary_rows
    from kvshare.pool.spawn import running_pool

    console = Console()
    os.makedirs(args.out, exist_ok=True)
    console.rule("kvshare demo: the shared pool")
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
    console.print(f"report written to {args.out}/")
    return 0 if stored == loaded and found == NUM_PAGES else 1
