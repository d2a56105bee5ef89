"""Diagnostic for the H200 (issue 18): does a load of pool pages run slower in a process that did not write them?

Through the service the 32B shape's 128k loads ran at 0.94-0.95 of a pinned copy on hugepages (replicas one
at a time: A stores and stops, B starts and loads), where the same load in one process ran at 0.99 and the
8B shape's 256k loads through the service (both replicas up together) at 0.99. What differs is who wrote and
pinned the pages before. This runs one pool daemon and, against its arena, processes that each map it and
register it with CUDA as a replica does (kvshare.transfer.registration), one after the other:

    writer        stores a random KV (CudaTransfer.store, as a replica's publish) and loads it back
    reader        a fresh process after the writer has exited (the 32B service's B): loads the same pages
    reader again  a second fresh process: is the first reader's rate repeatable
    reader+holder a fresh process while another process holds the arena registered, idle (the 8B service's B)

Each load is timed by its own CUDA events (CudaTransfer.load, every page checked, and the plan's copies
alone, no scatters), median of 3 after a warm-up, against a 1 GiB copy out of torch's pinned memory in the
same process; every load's bytes are compared with the KV stored.

    PYTHONPATH=.:/tmp/site python3 benchmarks/diagnostics/diag_arena_handover.py [--shape 32b] [--tokens 131072]
        [--pool-size 72GiB] [--hugepages] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROLES = ("writer", "reader", "reader again", "reader+holder")


def child(args) -> None:
    """One process's part: map, register, (store,) load and time; a JSON line on stdout."""
    import torch

    from kvshare.layout import KVLayout
    from kvshare.pool.client import PoolClient
    from kvshare.pool.protocol import PageHeader
    from kvshare.transfer import TransferConfig
    from kvshare.transfer.cuda import CudaTransfer
    from kvshare.transfer.layouts import as_bits
    from kvshare.transfer.roundtrip import random_kv
    from kvshare.transfer.scratch import reserve_scratch

    layout = KVLayout(num_layers={"32b": 64, "8b": 36}[args.shape], num_kv_heads=8, head_dim=128, dtype="bfloat16",
                      chunk_tokens=256)
    t0 = time.perf_counter()
    client = PoolClient(args.socket, name=args.role).connect()
    with CudaTransfer(layout, client, torch.device("cuda"), TransferConfig(verify_fraction=1.0)) as transfer:
        registered_s = time.perf_counter() - t0
        if args.role == "holder":
            print(json.dumps({"role": "holder", "registration_s": round(registered_s, 2)}), flush=True)
            sys.stdin.read()  # hold the registration until the parent closes our stdin
            return
        src = random_kv(layout, args.tokens, seed=7, device="cuda")  # the writer's KV, made again by every reader
        if args.role == "writer":
            scratch = reserve_scratch(client, layout.page_bytes, args.tokens // layout.chunk_tokens)
            sums = transfer.store(src, 0, scratch.offsets)
            with open(args.pages, "w") as f:
                json.dump({"offsets": scratch.offsets, "sums": sums, "kind": int(transfer.checksum_kind)}, f)
        with open(args.pages) as f:
            pages = json.load(f)
        headers = [PageHeader(offset=o, page_bytes=layout.page_bytes, checksum=s, checksum_kind=pages["kind"])
                   for o, s in zip(pages["offsets"], pages["sums"])]
        num_bytes = len(headers) * layout.page_bytes
        dst = torch.empty_like(src)
        pinned = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
        flat = dst.view(-1).view(torch.uint8)[: 1 << 30]
        reference = (1 << 30) / median_seconds(lambda s: flat.copy_(pinned, non_blocking=True)) / 1e9
        copies = num_bytes / plan_copies_seconds(client, transfer, pages["offsets"], layout) / 1e9
        loads, exact = [], True
        for i in range(4):
            handle = transfer.load(dst, 0, headers)
            handle.wait_all()
            torch.cuda.current_stream().synchronize()
            handle.verify()
            exact &= bool(torch.equal(as_bits(dst), as_bits(src)))
            if i:
                loads.append(handle.start.elapsed_time(handle.end) / 1e3)
        load = num_bytes / statistics.median(loads) / 1e9
    print(json.dumps({"role": args.role, "registration_s": round(registered_s, 2), "reference_GBps": round(reference, 2),
                      "plan_copies_GBps": round(copies, 2), "plan_copies_ratio": round(copies / reference, 3),
                      "load_GBps": round(load, 2), "load_ratio": round(load / reference, 3),
                      "load_ms": [round(s * 1e3, 1) for s in loads], "exact": exact}), flush=True)


def median_seconds(enqueue) -> float:
    """Median GPU seconds of enqueue(stream), after one warm-up: diag_load_pipeline's measure."""
    from diag_load_pipeline import median_seconds as measured  # beside this file, on sys.path as its folder

    return measured(enqueue)


def plan_copies_seconds(client, transfer, offsets: list[int], layout) -> float:
    """GPU seconds of the load's plan (load_units) executed back to back on one stream: copies, no scatters."""
    import torch

    from kvshare.transfer.copiers import make_copier
    from kvshare.transfer.plan import load_units

    units = [u for group in load_units(offsets, layout, transfer.config.min_copy_bytes, transfer.config.staging_bytes,
                                       client.hello.extent_bytes) for u in group]
    copier, base = make_copier("memcpy2d", torch.cuda.current_device()), transfer.registration.base_ptr

    def enqueue(stream):
        for i, unit in enumerate(units):
            copier.copy(unit.copies, client, base, transfer._staging[i % 2], stream, to_device=True)

    return median_seconds(enqueue)


def run_child(args, role: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", role, "--socket", args.socket, "--pages", args.pages,
           "--shape", args.shape, "--tokens", str(args.tokens)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, **popen)


def one_line(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line.strip():
        raise RuntimeError(f"a child printed nothing (exit {proc.wait()})")
    return json.loads(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32b", choices=("8b", "32b"))
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--pool-size", default="72GiB")
    ap.add_argument("--hugepages", action="store_true", help="the arena on reserved 2 MiB hugepages (--hugepages on)")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--socket", default="", help=argparse.SUPPRESS)
    ap.add_argument("--pages", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.role = args.child
        child(args)
        return 0

    from kvshare.pool.spawn import running_pool

    rows, ok = [], True
    mode = ("--hugepages", "on" if args.hugepages else "off")
    with running_pool(args.pool_size, mode, quiet=True) as sock:
        args.socket, args.pages = sock, os.path.join(os.path.dirname(sock), "pages.json")
        for role in ROLES:
            holder = run_child(args, "holder", stdin=subprocess.PIPE) if role == "reader+holder" else None
            try:
                if holder is not None:
                    one_line(holder)  # registered
                proc = run_child(args, role.split("+")[0].split(" ")[0])
                row = {**one_line(proc), "role": role, "hugepages": args.hugepages, "pool_size": args.pool_size,
                       "shape": args.shape, "tokens": args.tokens}
                ok &= proc.wait() == 0 and row["exact"]
            finally:
                if holder is not None:
                    holder.stdin.close()
                    holder.wait(timeout=120)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
