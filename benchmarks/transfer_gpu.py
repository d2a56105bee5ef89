"""Pool <-> GPU transfer benchmark for the H200: one command, JSON and a table under --out.

    PYTHONPATH=. python3 benchmarks/transfer_gpu.py --out $OUT [--quick]

For the Qwen3-8B KV shape (36 layers, 8 KV heads x 128, bf16, 256-token pages)
and Qwen3-32B (64 layers), against a real pool daemon with 1 GiB extents:

- the arena's CUDA registration time;
- load (pool -> GPU) and store (GPU -> pool) bandwidth of N tokens through
  CudaTransfer, per copy method, against ONE contiguous pinned <-> GPU copy of
  the same bytes measured in the same run (ratio; target >= 0.9). Store is
  given twice: the copies alone (GPU-timed) and the whole call with checksums;
- every run is checked byte for byte on the GPU (torch.equal after the round trip);
- the byte check library (kvshare.transfer.bytecheck) with the delay hook, on a
  second small pool whose extents are small enough to cross.

Exit status 1 when any byte check fails or any run raises; results so far are
written after every run, so a run cut short still leaves its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

MODELS = {"8b": 36, "32b": 64}  # layers; both: 8 KV heads x 128, bf16
DEVICE = "cuda"  # a test may point this at "cpu" under a fake CUDA to check the script's own logic
GiB = 1 << 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for transfer_gpu.json and transfer_gpu.txt")
    p.add_argument("--quick", action="store_true", help="8B only, 8k and 32k tokens, 2 repeats")
    p.add_argument("--models", default="8b,32b")
    p.add_argument("--tokens", default="8192,32768,131072")
    p.add_argument("--methods", default="memcpy2d,torch")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up")
    p.add_argument("--extent-size", default="1GiB")
    p.add_argument("--no-bytecheck", action="store_true")
    p.add_argument("--delay-cycles", type=int, default=500_000_000, help="GPU sleep of the ordering checks")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.tokens, args.repeats = "8b", "8192,32768", 2
    args.models = [m.strip() for m in args.models.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {sorted(MODELS)}")
    return args


def preflight() -> dict:
    """Fail early, with the fix, on what this machine lacks."""
    import torch

    if not torch.cuda.is_available():
        sys.exit("transfer_gpu: no CUDA device (torch.cuda.is_available() is False)")
    try:
        import msgspec  # noqa: F401  (the pool protocol)
    except ImportError:
        sys.exit("transfer_gpu: msgspec is missing (the pool needs it); carry a cp312 wheel and pip install it first")
    try:
        from importlib.metadata import version

        bindings = version("cuda-bindings")
    except Exception:
        bindings = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
        "cuda_bindings": bindings,
        "cpu_count": os.cpu_count(),
    }


def layout_of(model: str):
    from kvshare.layout import KVLayout

    return KVLayout(num_layers=MODELS[model], num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=256)


def pool_bytes(args, extent: int) -> int:
    """Extents to hold the largest run (a page never straddles extents), plus one spare."""
    need = 0
    for model in args.models:
        lay = layout_of(model)
        pages = max(args.tokens) // lay.chunk_tokens
        need = max(need, -(-pages // (extent // lay.page_bytes)))
    return (need + 1) * extent


def timed(fn, repeats: int) -> list[float]:
    """Wall seconds of fn() after one untimed warm-up, GPU idle before each."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def summary(num_bytes: int, times: list[float]) -> dict:
    best = min(times)
    return {"best_s": best, "median_s": statistics.median(times), "gbps": num_bytes / best / 1e9, "times_s": times}


def pinned_reference(dev_bytes, repeats: int) -> dict:
    """One contiguous pinned host buffer <-> GPU, the same bytes, same run: the ceiling to compare with."""
    import mmap

    import numpy as np
    import torch

    from kvshare.transfer.registration import register_range, unregister_range

    # page-aligned anonymous memory registered like the arena (torch's pinned allocator would round
    # 18 GiB up to 32 GiB)
    mapping = mmap.mmap(-1, dev_bytes.numel())
    host = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
    start = time.perf_counter()
    register_range(host.data_ptr(), host.numel())
    pin_s = time.perf_counter() - start
    try:
        h2d = timed(lambda: dev_bytes.copy_(host, non_blocking=True), repeats)
        d2h = timed(lambda: host.copy_(dev_bytes, non_blocking=True), repeats)
    finally:
        unregister_range(host.data_ptr())
    return {"pin_s": pin_s, "h2d": summary(dev_bytes.numel(), h2d), "d2h": summary(dev_bytes.numel(), d2h)}


def run_size(client, transfers: dict, model: str, tokens: int, repeats: int) -> list[dict]:
    """All methods for one (model, tokens): load/store bandwidth, ratios, exactness."""
    import torch

    from kvshare.pool.protocol import PageHeader
    from kvshare.transfer.layouts import as_bits
    from kvshare.transfer.roundtrip import random_kv
    from kvshare.transfer.scratch import reserve_scratch

    lay = layout_of(model)
    num_pages = tokens // lay.chunk_tokens
    num_bytes = num_pages * lay.page_bytes
    scratch = reserve_scratch(client, lay.page_bytes, num_pages)
    rows = []
    try:
        if len(scratch.offsets) < num_pages:
            raise RuntimeError(f"the pool granted {len(scratch.offsets)} of {num_pages} pages")
        src = random_kv(lay, tokens, seed=tokens, device=DEVICE)
        dst = torch.empty_like(src)
        reference = pinned_reference(dst.view(-1).view(torch.uint8), repeats)
        for method, transfer in transfers.items():
            row = {"model": model, "tokens": tokens, "pages": num_pages, "bytes": num_bytes, "method": method}
            try:
                sums = transfer.store(src, 0, scratch.offsets)
                headers = [
                    PageHeader(offset=o, page_bytes=lay.page_bytes, checksum=s, checksum_kind=transfer.checksum_kind)
                    for o, s in zip(scratch.offsets, sums)
                ]
                store_copy_s = []

                def store():
                    transfer.store(src, 0, scratch.offsets)
                    store_copy_s.append(transfer.last_store_copy_seconds)

                def load():
                    transfer.load(dst, 0, headers).wait_all()

                row["store"] = summary(num_bytes, timed(store, repeats))
                row["store"]["copy_only_gbps"] = num_bytes / min(store_copy_s[1:]) / 1e9
                dst.view(torch.uint8).fill_(0)
                row["load"] = summary(num_bytes, timed(load, repeats))
                row["exact"] = bool(torch.equal(as_bits(dst), as_bits(src)))
                row["load_ratio"] = row["load"]["gbps"] / reference["h2d"]["gbps"]
                row["store_ratio"] = row["store"]["copy_only_gbps"] / reference["d2h"]["gbps"]
                row["store_with_checksums_ratio"] = row["store"]["gbps"] / reference["d2h"]["gbps"]
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
                row["traceback"] = traceback.format_exc()
                print(row["traceback"], file=sys.stderr, flush=True)
            row["reference"] = reference
            rows.append(row)
            print(f"  {model} {tokens} {method}: {short(row)}", flush=True)
        src = dst = None  # this size's tensors go before the cache is emptied
        torch.cuda.empty_cache()
    finally:
        scratch.release(client)
    return rows


def short(row: dict) -> str:
    if "error" in row:
        return "ERROR " + row["error"]
    return (
        f"load {row['load']['gbps']:.1f} GB/s ({row['load_ratio']:.2f}), "
        f"store {row['store']['copy_only_gbps']:.1f} GB/s "
        f"({row['store_ratio']:.2f}), store+checksums {row['store']['gbps']:.1f} GB/s, exact={row['exact']}"
    )


def table(results: dict) -> str:
    env = results["env"]
    lines = [f"device: {env['device']}, torch {env['torch']}, cuda-bindings {env['cuda_bindings']}"]
    pool = results.get("pool", {})
    if pool:
        lines.append(
            f"pool: {pool['size_bytes'] / GiB:.0f} GiB, extents {pool['extent_bytes'] / GiB:.2f} GiB, "
            f"registration {pool['registration_s']:.2f} s "
            f"({pool['size_bytes'] / pool['registration_s'] / 1e9:.1f} GB/s)"
        )
    lines.append(
        f"{'model':5} {'tokens':>7} {'GiB':>6} {'method':9} {'load GB/s':>9} {'ratio':>6} {'store GB/s':>10} "
        f"{'ratio':>6} {'+cksum':>7} {'ref h2d/d2h':>12} exact"
    )
    for r in results["runs"]:
        head = f"{r['model']:5} {r['tokens']:>7} {r['bytes'] / GiB:>6.2f} {r['method']:9}"
        if "error" in r:
            lines.append(f"{head} ERROR {r['error'][:80]}")
            continue
        flag = lambda x: f"{x:.2f}" + ("*" if x < 0.9 else " ")  # noqa: E731
        ref = r["reference"]
        lines.append(
            f"{head} {r['load']['gbps']:>9.1f} {flag(r['load_ratio']):>6} "
            f"{r['store']['copy_only_gbps']:>10.1f} {flag(r['store_ratio']):>6} "
            f"{r['store']['gbps']:>7.1f} {ref['h2d']['gbps']:>5.1f}/{ref['d2h']['gbps']:<6.1f} {r['exact']}"
        )
    lines.append("(* ratio below the 0.9 target; +cksum: store GB/s including checksums, what a caller waits for)")
    if "bytecheck" in results:
        lines.append(results["bytecheck"]["table"])
    lines.append(f"OVERALL: {'OK' if results['ok'] else 'FAILED'}")
    return "\n".join(lines)


def bench_model(client, model: str, args, results: dict, save) -> None:
    import torch

    from kvshare.transfer import TransferConfig
    from kvshare.transfer.cuda import CudaTransfer

    lay = layout_of(model)
    print(f"{model}: page {lay.page_bytes / 2**20:.0f} MiB, {lay.num_layers} layers", flush=True)
    transfers = {}
    try:
        for method in args.methods:
            transfers[method] = CudaTransfer(lay, client, torch.device(DEVICE), TransferConfig(copy_method=method))
        for tokens in args.tokens:
            rows = run_size(client, transfers, model, tokens, args.repeats)
            results["runs"].extend(rows)
            results["ok"] &= all("error" not in r and r["exact"] for r in rows)
            save()
    finally:
        for transfer in transfers.values():
            transfer.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results: dict = {"args": {k: v for k, v in vars(args).items()}, "env": preflight(), "runs": [], "ok": True}
    json_path, txt_path = os.path.join(args.out, "transfer_gpu.json"), os.path.join(args.out, "transfer_gpu.txt")

    def save():
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1, default=str)

    from kvshare.pool.client import PoolClient
    from kvshare.pool.spawn import running_pool
    from kvshare.transfer.registration import acquire_registration, release_registration
    from kvshare.units import parse_size

    extent = parse_size(args.extent_size)
    size = pool_bytes(args, extent)
    print(
        f"transfer_gpu: {results['env']}\nstarting a {size / GiB:.0f} GiB pool (extents {extent / GiB:.2f} GiB)",
        flush=True,
    )
    try:
        with running_pool(size, ("--extent-size", str(extent)), stdout=subprocess.DEVNULL) as socket_path:
            with PoolClient(socket_path, name="transfer-bench") as client:
                reg = acquire_registration(client)  # held for the whole run; the transfers share it
                results["pool"] = {
                    "size_bytes": size,
                    "extent_bytes": extent,
                    "registration_s": reg.seconds,
                    "pieces": len(reg.pieces),
                }
                print(f"registered {size / GiB:.0f} GiB in {len(reg.pieces)} pieces: {reg.seconds:.2f} s", flush=True)
                try:
                    for model in args.models:
                        bench_model(client, model, args, results, save)
                finally:
                    release_registration(reg)
        if not args.no_bytecheck:
            results["bytecheck"] = run_bytecheck(args)
            results["ok"] &= results["bytecheck"]["ok"]
    except Exception:
        results["ok"] = False
        results["fatal"] = traceback.format_exc()
        print(results["fatal"], file=sys.stderr, flush=True)
    save()
    text = table(results)
    with open(txt_path, "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    return 0 if results["ok"] else 1


def run_bytecheck(args) -> dict:
    """The byte check with the delay hook, on a small pool whose 64 MiB extents the scratch pages cross."""
    from dataclasses import asdict

    from kvshare.pool.client import PoolClient
    from kvshare.pool.spawn import running_pool
    from kvshare.transfer.bytecheck import run_bytecheck as bytecheck
    from kvshare.transfer.roundtrip import ByteCheckConfig

    print("byte check (delay-injection) ...", flush=True)
    with running_pool("512MiB", ("--extent-size", "64MiB"), stdout=subprocess.DEVNULL) as socket_path:
        with PoolClient(socket_path, name="transfer-bench-bytecheck") as client:
            report = bytecheck(
                client, ByteCheckConfig(copy_methods=tuple(args.methods), delay_cycles=args.delay_cycles)
            )
    return {
        "ok": report.ok,
        "table": report.table(),
        "num_pages": report.num_pages,
        "extent_boundaries": report.extent_boundaries,
        "results": [asdict(r) | {"passed": r.passed, "caught": r.caught} for r in report.results],
    }


if __name__ == "__main__":
    sys.exit(main())
