"""Diagnostic for the H200 (issue 18): where a pool load loses its last ~5% of PCIe.

One copy out of registered memory runs at ~55.2 GB/s and so does the load's 2-D copy pattern on its
own (diag_h2d_memory); a whole CudaTransfer.load runs at 52-53 GB/s in the engine and the service.
In between lie the staging pipeline (a copy into a buffer waits for the scatter out of it two units
back), the page checks summed beside the scatters, and the compute the load overlaps. This measures
one load of the Qwen3-32B shape at 131072 tokens (32 GiB) out of a real pool, every variant in the
same run against the same reference:

    reference   one 1-D copy of 4 GiB out of registered anonymous memory
    copies      the load's plan (load_units) executed back to back on one stream, no scatters, no waits
    load        CudaTransfer.load(...).wait_all(): staging buffers x size, pages checked or not, with or
                without a side stream of bf16 matmuls (all SMs busy) running through the whole load

Each variant: one warm-up, then REPEATS loads; GB/s of the median by the load's own CUDA events
(start on the copy stream -> end after the last scatter), and the bytes checked equal after each.

With EXTENTS (pool extent sizes, e.g. 256MiB,1GiB,4GiB) only the copies alone and the loads with and
without checks run, once per extent size, each against a pool of its own: a run of pages never
crosses an extent (each is its own CUDA registration), so with the pool's default 256 MiB extents a
32B-shape run holds at most 4 pages of 64 MiB, and each 2-D copy moves 8 MiB (the line printed per
pool gives the number of copies and their mean size).

SHAPE (32b, the default, or 8b) picks the KV layout: the Qwen3-32B shape (64 MiB pages) or the
Qwen3-8B shape (36 MiB pages).

    PYTHONPATH=.:/tmp/site python3 benchmarks/diagnostics/diag_load_pipeline.py [TOKENS [EXTENTS [SHAPE]]]
"""
import json
import mmap
import statistics
import sys
import time

import numpy as np
import torch

from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.protocol import PageHeader
from kvshare.pool.spawn import running_pool
from kvshare.transfer import TransferConfig
from kvshare.transfer.copiers import make_copier
from kvshare.transfer.cuda import CudaTransfer
from kvshare.transfer.layouts import as_bits
from kvshare.transfer.plan import load_units
from kvshare.transfer.registration import acquire_registration, register_range, release_registration, unregister_range
from kvshare.transfer.roundtrip import random_kv
from kvshare.transfer.scratch import reserve_scratch
from kvshare.units import parse_size

GiB, MiB = 1 << 30, 1 << 20
TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
EXTENTS = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else None  # None: the pool's default, every variant
SHAPE = sys.argv[3] if len(sys.argv) > 3 else "32b"
REPEATS = 3
LAYOUT = KVLayout(num_layers={"32b": 64, "8b": 36}[SHAPE], num_kv_heads=8, head_dim=128, dtype="bfloat16",
                  chunk_tokens=256)
VARIANTS = [  # (name, TransferConfig fields, matmuls beside)
    ("2x256MiB", {}, False),
    ("2x256MiB checked", {"verify_fraction": 1.0}, False),
    ("2x256MiB checked +compute", {"verify_fraction": 1.0}, True),
    ("3x256MiB checked", {"verify_fraction": 1.0, "staging_buffers": 3}, False),
    ("4x256MiB checked", {"verify_fraction": 1.0, "staging_buffers": 4}, False),
    ("4x256MiB checked +compute", {"verify_fraction": 1.0, "staging_buffers": 4}, True),
    ("4x128MiB checked", {"verify_fraction": 1.0, "staging_buffers": 4, "staging_bytes": 128 * MiB}, False),
    ("2x512MiB checked", {"verify_fraction": 1.0, "staging_bytes": 512 * MiB}, False),
    ("2x256MiB", {}, False),  # again at the end: drift
]


def reference_gbps(dev: torch.Tensor) -> float:
    mapping = mmap.mmap(-1, dev.numel())
    host = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
    register_range(host.data_ptr(), host.numel())
    try:
        return dev.numel() / median_seconds(lambda s: dev.copy_(host, non_blocking=True)) / 1e9
    finally:
        unregister_range(host.data_ptr())


def median_seconds(enqueue) -> float:
    """Median GPU seconds of enqueue(stream) on the current stream, after one warm-up."""
    stream = torch.cuda.current_stream()
    times = []
    for i in range(REPEATS + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        enqueue(stream)
        end.record(stream)
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def plan_copies(client, transfer: CudaTransfer, offsets: list[int], num_bytes: int) -> tuple[float, int]:
    """GB/s of the load's plan executed back to back on one stream, and how many 2-D copies it holds."""
    units = [u for group in load_units(offsets, LAYOUT, transfer.config.min_copy_bytes, transfer.config.staging_bytes,
                                       client.hello.extent_bytes) for u in group]
    copier = make_copier("memcpy2d", torch.cuda.current_device())
    base = transfer.registration.base_ptr

    def enqueue(stream):
        for i, unit in enumerate(units):
            copier.copy(unit.copies, client, base, transfer._staging[i % 2], stream, to_device=True)

    return num_bytes / median_seconds(enqueue) / 1e9, sum(len(u.copies) for u in units)


def busy_side_stream(seconds: float) -> torch.cuda.Stream:
    """A side stream with ~``seconds`` of 8192^2 bf16 matmuls enqueued (every SM busy)."""
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a.record_stream(side)  # not handed back to the allocator before the side stream is done with it
    with torch.cuda.stream(side):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        count = int(seconds / (start.elapsed_time(end) / 1e3 / 10)) + 1
        for _ in range(count):
            a @ a
    return side


def measure(client, headers, src, dst, fields: dict, compute: bool) -> dict:
    config = TransferConfig(**fields)
    num_bytes = len(headers) * LAYOUT.page_bytes
    device_s, wall_s, exact = [], [], True
    with CudaTransfer(LAYOUT, client, torch.device("cuda"), config) as transfer:
        for i in range(REPEATS + 1):
            dst.view(-1).view(torch.uint8)[:: 1 << 20].fill_(0)
            side = busy_side_stream(1.0) if compute else None  # outlasts the load
            torch.cuda.current_stream().synchronize()
            t0 = time.perf_counter()
            handle = transfer.load(dst, 0, headers)
            handle.wait_all()
            torch.cuda.current_stream().synchronize()
            wall = time.perf_counter() - t0
            handle.verify()
            if side is not None:
                side.synchronize()
            exact &= bool(torch.equal(as_bits(dst), as_bits(src)))
            if i:
                device_s.append(handle.start.elapsed_time(handle.end) / 1e3)
                wall_s.append(wall)
    return {"device_GBps": round(num_bytes / statistics.median(device_s) / 1e9, 2),
            "wall_GBps": round(num_bytes / statistics.median(wall_s) / 1e9, 2),
            "device_ms": [round(s * 1e3, 1) for s in device_s], "exact": exact}


def main() -> int:
    ok = True
    if EXTENTS is None:
        return 0 if one_pool(None, VARIANTS) else 1
    for extent in EXTENTS:
        ok &= one_pool(extent, VARIANTS[:2])
    return 0 if ok else 1


def one_pool(extent: str | None, variants: list) -> bool:
    num_pages = TOKENS // LAYOUT.chunk_tokens
    num_bytes = num_pages * LAYOUT.page_bytes
    ok = True
    extra = ("--extent-size", extent) if extent else ()
    size = num_bytes + 2 * max(GiB, parse_size(extent) if extent else 0)
    with running_pool(size, extra, quiet=True) as sock, PoolClient(sock, name="diag-load") as client:
        reg = acquire_registration(client)
        scratch = reserve_scratch(client, LAYOUT.page_bytes, num_pages)
        try:
            src = random_kv(LAYOUT, TOKENS, seed=5, device="cuda")
            dst = torch.empty_like(src)
            with CudaTransfer(LAYOUT, client, torch.device("cuda"), TransferConfig()) as transfer:
                sums = transfer.store(src, 0, scratch.offsets)
                headers = [PageHeader(offset=o, page_bytes=LAYOUT.page_bytes, checksum=s, checksum_kind=transfer.checksum_kind)
                           for o, s in zip(scratch.offsets, sums)]
                ref = reference_gbps(dst.view(-1).view(torch.uint8)[: 4 * GiB])
                copies, num_copies = plan_copies(client, transfer, scratch.offsets, num_bytes)
            print(json.dumps({"shape": SHAPE, "tokens": TOKENS, "GiB": round(num_bytes / GiB, 2), "extent": client.hello.extent_bytes,
                              "registration_s": round(reg.seconds, 2), "reference_GBps": round(ref, 2),
                              "plan_copies_GBps": round(copies, 2), "plan_copies_ratio": round(copies / ref, 3),
                              "copies": num_copies, "MiB_per_copy": round(num_bytes / num_copies / MiB, 1)}), flush=True)
            for name, fields, compute in variants:
                row = measure(client, headers, src, dst, fields, compute)
                ok &= row["exact"]
                print(json.dumps({"variant": name, "extent": client.hello.extent_bytes, **row,
                                  "ratio": round(row["device_GBps"] / ref, 3)}), flush=True)
            del src, dst
            torch.cuda.empty_cache()
        finally:
            scratch.release(client)
            release_registration(reg)
    return ok


if __name__ == "__main__":
    sys.exit(main())
