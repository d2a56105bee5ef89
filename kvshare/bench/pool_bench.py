"""``kvshare bench pool``: data-plane bandwidth and control-plane latency of the pool.

Data plane: a writer process puts pages (reserve, copy in, checksum, commit) and a
separate reader process gets them (lookup-and-lease, copy out, release). Both
bandwidths are reported as a ratio against a plain memcpy of the same bytes
between two private buffers, measured in the same run the way the copy is (a
torch copy in the writer process, the same threads, medians of the passes), with
the absolute GB/s beside it. Control plane: one client, one request in flight at
a time, lookup-and-lease + release of a chain of committed keys.

Every result records the CPU pressure (Linux PSI, /proc/pressure/cpu: the share
of time some runnable task waited for a core) over the run and flags a run as
contended past ``CONTENDED_PSI_PCT``: its latencies say more about the
neighbours than about the pool.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvshare.pool.spin import CONTENDED_SHARE, PSI_CPU_PATH

NAMESPACE = hashlib.blake2b(b"kvshare-bench-pool", digest_size=16).digest()
# "some" CPU pressure (avg10) above which a run is flagged as contended: where the pool's waits stop spinning
CONTENDED_PSI_PCT = CONTENDED_SHARE * 100


@dataclass(frozen=True)
class PoolBenchConfig:
    socket_path: str
    page_bytes: int = 2 << 20  # one chunk of the tiny preset (8 layers, 2 KV heads x 64, float32)
    num_pages: int = 128
    pages_per_request: int = 16
    repeats: int = 3
    lookup_ops: int = 20000
    lookup_keys: int = 8

    def __post_init__(self) -> None:
        if self.num_pages % self.pages_per_request:
            raise ValueError("num_pages must be a multiple of pages_per_request")


def bench_keys(tag: str, count: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(count)]


def parse_psi_some_avg10(text: str) -> float | None:
    """The ``some avg10`` figure (percent) of a /proc/pressure file's text; None when it has none."""
    for line in text.splitlines():
        kind, *fields = line.split()
        if kind == "some":
            values = dict(field.split("=", 1) for field in fields)
            try:
                return float(values["avg10"])
            except (KeyError, ValueError):
                return None
    return None


def cpu_waited_us(path: str = PSI_CPU_PATH) -> int | None:
    """Microseconds since boot in which some runnable task waited for a core (PSI some total); None without PSI."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("some "):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError):
        return None
    return None


def lookup_round_trips(client, keys: list[bytes], page_bytes: int, num_ops: int = 0, seconds: float = 0.0) -> dict:
    """Lookup-and-lease + release back to back, ``num_ops`` times or for ``seconds``: the rate, p50 and p99, and
    the share of the time some runnable task waited for a core (PSI; None without it)."""
    if num_ops <= 0 and seconds <= 0:
        raise ValueError("give a number of round trips or a duration")
    latencies = []
    waited_start = cpu_waited_us()
    t_start = time.perf_counter()
    deadline = t_start + seconds if seconds > 0 else float("inf")
    while len(latencies) < (num_ops if num_ops > 0 else float("inf")):
        t0 = time.perf_counter()
        if t0 >= deadline:
            break
        lease = client.lookup(keys, page_bytes)
        client.release([lease.lease_id])
        latencies.append(time.perf_counter() - t0)
    total = time.perf_counter() - t_start
    client.stats()  # round trip: every release has been handled
    waited_end = cpu_waited_us()
    latencies.sort()
    return {
        "lookup_ops_per_s": len(latencies) / total,
        "lookup_p50_us": latencies[len(latencies) // 2] * 1e6,
        "lookup_p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
        "cpu_waited_pct": None if None in (waited_start, waited_end) else (waited_end - waited_start) / total / 1e4,
    }


def cpu_pressure_pct(path: str = PSI_CPU_PATH) -> float | None:
    """CPU pressure now (PSI some avg10, percent); None where the kernel has no PSI."""
    try:
        with open(path) as f:
            return parse_psi_some_avg10(f.read())
    except OSError:
        return None


def _median(values: list[float]) -> float:
    return float(np.median(values))


def grant_runs(grants: list[tuple[int, int]], page_bytes: int) -> list[tuple[int, int, int]]:
    """(first key index, first page offset, count) of each run of consecutive keys on consecutive pages."""
    runs: list[list[int]] = []
    for index, offset in grants:
        if runs and runs[-1][0] + runs[-1][2] == index and runs[-1][1] + runs[-1][2] * page_bytes == offset:
            runs[-1][2] += 1
        else:
            runs.append([index, offset, 1])
    return [tuple(r) for r in runs]


def _checksum_gbps(page_bytes: int, num_pages: int) -> float:
    from kvshare.pool.checksum import page_checksum

    data = np.random.default_rng(2).integers(0, 255, (num_pages, page_bytes), dtype=np.uint8)
    t0 = time.perf_counter()
    for page in data:
        page_checksum(page)
    return data.nbytes / (time.perf_counter() - t0) / 1e9


def _writer(cfg: PoolBenchConfig, tag: str, queue) -> None:
    import torch

    from kvshare.pool.checksum import page_checksum
    from kvshare.pool.client import PoolClient

    rng = np.random.default_rng(1)
    data = rng.integers(0, 255, (cfg.num_pages, cfg.page_bytes), dtype=np.uint8)
    times = []
    memcpy_dst = torch.empty((cfg.num_pages, cfg.page_bytes), dtype=torch.uint8)
    memcpy_times = []
    for _ in range(cfg.repeats + 1):  # the reference: the same copy into a private buffer (the first faults it in)
        t0 = time.perf_counter()
        memcpy_dst.copy_(torch.from_numpy(data))
        memcpy_times.append(time.perf_counter() - t0)
    with PoolClient(cfg.socket_path, name="bench-writer") as client:
        for rep in range(cfg.repeats + 1):  # the first pass faults the arena's pages in and is not timed
            keys = bench_keys(f"{tag}/{rep}", cfg.num_pages)
            if rep:
                client.flush(NAMESPACE)  # later passes reuse the same (faulted) pages
            t0 = time.perf_counter()
            for start in range(0, cfg.num_pages, cfg.pages_per_request):
                batch = keys[start : start + cfg.pages_per_request]
                res = client.reserve(NAMESPACE, batch, cfg.page_bytes, first_depth=start)
                sums = []
                for first, offset, count in grant_runs(res.grants, cfg.page_bytes):
                    run = client.run(offset, cfg.page_bytes, count)
                    torch.from_numpy(run).copy_(torch.from_numpy(data[start + first : start + first + count]))
                    sums += [page_checksum(page) for page in run]
                client.commit(res.reservation_id, sums)
                if res.num_no_room:
                    raise RuntimeError("the pool is too small for the benchmark; give it more room")
            elapsed = time.perf_counter() - t0
            if rep:
                times.append(elapsed)
        copy_times = []
        for rep in range(cfg.repeats):  # the data plane alone: reserve + copy, then abort (never visible)
            keys = bench_keys(f"{tag}/copy-only/{rep}", cfg.num_pages)
            t0 = time.perf_counter()
            for start in range(0, cfg.num_pages, cfg.pages_per_request):
                res = client.reserve(NAMESPACE, keys[start : start + cfg.pages_per_request], cfg.page_bytes)
                for first, offset, count in grant_runs(res.grants, cfg.page_bytes):
                    run = client.run(offset, cfg.page_bytes, count)
                    torch.from_numpy(run).copy_(torch.from_numpy(data[start + first : start + first + count]))
                client.abort(res.reservation_id)
            copy_times.append(time.perf_counter() - t0)
    queue.put(
        {
            "put_s": _median(times),
            "put_copy_only_s": _median(copy_times),
            "memcpy_s": _median(memcpy_times[1:]),
            "checksum": [int(page_checksum(d)) for d in data[:4]],
        }
    )


def _reader(cfg: PoolBenchConfig, tag: str, queue) -> None:
    import torch

    from kvshare.pool.client import PoolClient

    out = torch.zeros((cfg.pages_per_request, cfg.page_bytes), dtype=torch.uint8)
    times, first_sums = [], []
    from kvshare.pool.checksum import page_checksum

    with PoolClient(cfg.socket_path, name="bench-reader") as client:
        keys = bench_keys(f"{tag}/{cfg.repeats}", cfg.num_pages)  # the writer's last pass
        for rep in range(1, cfg.repeats + 2):
            t0 = time.perf_counter()
            for start in range(0, cfg.num_pages, cfg.pages_per_request):
                lease = client.lookup(keys[start : start + cfg.pages_per_request], cfg.page_bytes)
                if lease.num_pages != cfg.pages_per_request:
                    raise RuntimeError(f"reader found {lease.num_pages} of {cfg.pages_per_request} pages")
                runs = grant_runs([(j, h.offset) for j, h in enumerate(lease.pages)], cfg.page_bytes)
                for first, offset, count in runs:
                    out[first : first + count].copy_(torch.from_numpy(client.run(offset, cfg.page_bytes, count)))
                client.release([lease.lease_id])
                if start == 0 and rep == 1:
                    first_sums = [int(page_checksum(p)) for p in out[:4].numpy()]
            if rep > 1:  # the first pass maps the pages into this process and is not timed
                times.append(time.perf_counter() - t0)
    queue.put({"get_s": _median(times), "checksum": first_sums})


def _control_plane(cfg: PoolBenchConfig, queue) -> None:
    from kvshare.pool.client import PoolClient

    keys = bench_keys("control", cfg.lookup_keys)
    page_bytes = 4096
    figures = {}
    # the client an engine's PoolLink makes (direct where the pool offers it), and the round trip as the reference
    with (
        PoolClient(cfg.socket_path, name="bench-control", direct=True) as client,
        PoolClient(cfg.socket_path, name="bench-control-round-trip") as round_trip,
    ):
        res = client.reserve(NAMESPACE, keys, page_bytes)
        client.commit(res.reservation_id, [0] * len(res.grants))
        for name, each in (("", client), ("round_trip_", round_trip)):
            lookup_round_trips(each, keys, page_bytes, num_ops=500)  # warm up
            figures |= {f"{name}{k}": v for k, v in lookup_round_trips(each, keys, page_bytes, cfg.lookup_ops).items()}
        figures["lookup_path"] = "direct" if client.is_direct else "round_trip"
    queue.put(figures)


def _in_process(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    try:
        result = queue.get(timeout=600)
    finally:
        proc.join(timeout=60)
    if proc.exitcode not in (0, None):
        raise RuntimeError(f"benchmark process {target.__name__} failed with exit code {proc.exitcode}")
    return result


def run_pool_bench(cfg: PoolBenchConfig) -> dict:
    """Run every measurement and return the figures (keys as in ``kvshare bench pool --json``)."""
    tag = f"run{os.getpid()}-{time.time_ns()}"
    total = cfg.num_pages * cfg.page_bytes
    pressures = [cpu_pressure_pct()]
    checksum_gbps = _checksum_gbps(cfg.page_bytes, cfg.num_pages)
    written = _in_process(_writer, cfg, tag)
    read = _in_process(_reader, cfg, tag)
    if written["checksum"] != read["checksum"]:
        raise RuntimeError("the reader got different bytes than the writer stored")
    control = _in_process(_control_plane, cfg)
    pressures.append(cpu_pressure_pct())
    pressure = None if None in pressures else max(pressures)
    memcpy_gbps = total / written["memcpy_s"] / 1e9
    put_gbps = total / written["put_s"] / 1e9
    put_copy_gbps = total / written["put_copy_only_s"] / 1e9
    get_gbps = total / read["get_s"] / 1e9
    return {
        "bytes_per_pass": total,
        "page_bytes": cfg.page_bytes,
        "memcpy_gbps": round(memcpy_gbps, 3),
        "checksum_gbps": round(checksum_gbps, 3),
        "put_gbps": round(put_gbps, 3),
        "get_gbps": round(get_gbps, 3),
        "put_ratio_vs_memcpy": round(put_gbps / memcpy_gbps, 3),
        "put_copy_only_gbps": round(put_copy_gbps, 3),
        "put_copy_only_ratio_vs_memcpy": round(put_copy_gbps / memcpy_gbps, 3),
        "get_ratio_vs_memcpy": round(get_gbps / memcpy_gbps, 3),
        "lookup_ops_per_s": round(control["lookup_ops_per_s"], 1),
        "lookup_p50_us": round(control["lookup_p50_us"], 1),
        "lookup_p99_us": round(control["lookup_p99_us"], 1),
        "lookup_path": control["lookup_path"],  # direct: the pool's directory, no round trip (kvshare.pool.direct)
        "lookup_round_trip_ops_per_s": round(control["round_trip_lookup_ops_per_s"], 1),
        "lookup_round_trip_p50_us": round(control["round_trip_lookup_p50_us"], 1),
        "lookup_round_trip_p99_us": round(control["round_trip_lookup_p99_us"], 1),
        "cpu_pressure_pct": pressure,  # PSI some avg10, the higher of the run's start and end; None without PSI
        "is_contended": pressure is not None and pressure > CONTENDED_PSI_PCT,
        "config": asdict(cfg),
    }


def summary_rows(result: dict) -> list[tuple[str, str, str]]:
    """(measure, figure, reference) rows for a table."""
    return [
        ("memcpy (reference)", f"{result['memcpy_gbps']:.2f} GB/s", "1.00x"),
        (
            "put: reserve+copy+checksum+commit",
            f"{result['put_gbps']:.2f} GB/s",
            f"{result['put_ratio_vs_memcpy']:.2f}x memcpy",
        ),
        (
            "put data plane alone: reserve+copy (aborted)",
            f"{result['put_copy_only_gbps']:.2f} GB/s",
            f"{result['put_copy_only_ratio_vs_memcpy']:.2f}x memcpy",
        ),
        (
            "get: lookup+lease+copy+release",
            f"{result['get_gbps']:.2f} GB/s",
            f"{result['get_ratio_vs_memcpy']:.2f}x memcpy",
        ),
        ("page checksum (xxh3-64), part of put", f"{result['checksum_gbps']:.2f} GB/s", ""),
        (
            f"lookup-and-lease + release ({result['lookup_path'].replace('_', ' ')})",
            f"{result['lookup_ops_per_s']:,.0f} /s",
            f"p50 {result['lookup_p50_us']:.0f} us, p99 {result['lookup_p99_us']:.0f} us",
        ),
        (
            "... the same over the socket (round trip)",
            f"{result['lookup_round_trip_ops_per_s']:,.0f} /s",
            f"p50 {result['lookup_round_trip_p50_us']:.0f} us, p99 {result['lookup_round_trip_p99_us']:.0f} us",
        ),
        (
            "CPU pressure (PSI some avg10)",
            "n/a" if result["cpu_pressure_pct"] is None else f"{result['cpu_pressure_pct']:.1f} %",
            "CONTENDED: other work waited for the cores" if result["is_contended"] else "",
        ),
    ]
