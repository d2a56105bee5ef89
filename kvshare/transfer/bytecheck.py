"""The byte round-trip self-test: random KV through every transfer path here, store then load.

Part of the product (``kvshare validate`` runs it against the live pool), not
only of the tests. For each path (``cpu``; ``cuda/memcpy2d`` and ``cuda/torch``
on a GPU, over the registered arena) and each case (a long run in allocation
order, a shifted first chunk, scattered pages, pages around extent =
registration boundaries, a single page):

- the pages stored are canonical: byte-equal to the slow reference converter
  (a sample of pages), and their checksums match;
- the bytes loaded equal the bytes stored, and nothing outside the loaded
  chunks changes.

On CUDA, ``ordercheck`` adds the delay-injection checks (see there). Scratch
pages are reserved under throwaway keys and aborted: nothing becomes visible.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvshare.layout import KVLayout
from kvshare.pool.checksum import page_checksum
from kvshare.pool.protocol import PageHeader
from kvshare.transfer.base import TransferConfig, make_transfer
from kvshare.transfer.layouts import as_bits, torch_dtype
from kvshare.transfer.reference import page_bytes_of, reference_engine_to_pages
from kvshare.transfer.scratch import reserve_scratch

DEFAULT_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=32)  # 64 KiB pages
SENTINEL = 0x5A


@dataclass(frozen=True)
class PathResult:
    """One path's (or one ordering check's) outcome."""

    path: str  # e.g. "cpu", "cuda/memcpy2d", "cuda/memcpy2d store-order"
    kind: str  # "round_trip" | "ordering" | "control" (a deliberately broken variant that must be caught)
    num_cases: int
    bytes_checked: int
    mismatched_bytes: int
    seconds: float
    skipped: str = ""  # why the path did not run on this machine ("" when it ran)
    detail: str = ""

    @property
    def caught(self) -> bool:
        return self.mismatched_bytes > 0

    @property
    def passed(self) -> bool:
        if self.skipped:
            return True
        if self.kind == "control":
            return self.caught
        return self.bytes_checked > 0 and self.mismatched_bytes == 0


@dataclass(frozen=True)
class ByteCheckConfig:
    layout: KVLayout = DEFAULT_LAYOUT
    max_pages: int = 1 << 17  # scratch pages reserved (never touched unless a case copies them): past one extent
    max_run_pages: int = 64  # pages of the "runs" case (the extent cases take their pages around each boundary)
    seed: int = 0
    copy_methods: tuple[str, ...] = ("memcpy2d", "torch")  # CUDA paths to try
    cuda: bool = True  # also check CUDA paths when torch sees a GPU
    delay_cycles: int = 500_000_000  # GPU sleep for the ordering checks (~0.25 s at 2 GHz)
    reference_pages: int = 2  # pages per case compared with the slow reference converter
    transfer: TransferConfig | None = None  # None: small groups and staging, to exercise every unit boundary


@dataclass(frozen=True)
class ByteCheckReport:
    results: tuple[PathResult, ...]
    layout: KVLayout
    num_pages: int
    extent_bytes: int
    extent_boundaries: int  # extent boundaries inside the scratch pages the cases covered
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return all(r.passed for r in self.results)

    def table(self) -> str:
        rows = [f"{'path':34} {'kind':10} {'cases':>5} {'bytes':>12} {'wrong':>12} {'s':>7}  verdict"]
        for r in self.results:
            verdict = f"skipped: {r.skipped}" if r.skipped else ("caught" if r.kind == "control" and r.caught else "ok" if r.passed else "FAIL")
            rows.append(f"{r.path:34} {r.kind:10} {r.num_cases:>5} {r.bytes_checked:>12} {r.mismatched_bytes:>12} {r.seconds:>7.3f}  {verdict}")
        return "\n".join(rows + list(self.notes))


def stress_config(layout: KVLayout) -> TransferConfig:
    """One layer per group and three pages per unit: many units, both staging buffers, every seam."""
    return TransferConfig(min_copy_bytes=layout.layer_bytes, staging_bytes=3 * layout.layer_bytes, verify_fraction=1.0)


def make_cases(offsets: list[int], extent_bytes: int, seed: int, max_run_pages: int = 64) -> list[tuple[str, int, list[int]]]:
    """(name, first_chunk, page offsets) of each case, from scratch pages in allocation order."""
    n = len(offsets)
    rng = random.Random(seed)
    cases = [("runs", 0, list(offsets[:max_run_pages])), ("shifted", 3, offsets[1 : min(n, 7)])]
    sample = rng.sample(offsets, min(n, 16))
    cases.append(("scattered", 1, sample))
    boundaries = [i for i in range(1, n) if offsets[i] // extent_bytes != offsets[i - 1] // extent_bytes]
    for i in boundaries[:3]:
        cases.append((f"extent@{offsets[i]}", 2, offsets[max(0, i - 2) : i + 2]))
    cases.append(("single", 5, [offsets[-1]]))
    return [c for c in cases if c[2]]


def count_boundaries(offsets: list[int], extent_bytes: int) -> int:
    return sum(1 for i in range(1, len(offsets)) if offsets[i] // extent_bytes != offsets[i - 1] // extent_bytes)


def mismatched_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    if torch.equal(as_bits(a), as_bits(b)):  # the common case, without a byte-sized temporary
        return 0
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def bytes_not_sentinel(t: torch.Tensor) -> int:
    """Bytes of t that no longer hold the sentinel (t: a region nothing should have written)."""
    return int((t.contiguous().view(torch.uint8) != SENTINEL).sum()) if t.numel() else 0


def random_kv(layout: KVLayout, num_tokens: int, seed: int, device) -> torch.Tensor:
    """kv [L, 2, H, T, D] of random bits (NaN patterns included), generated on ``device``."""
    kv = torch.empty((layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim), dtype=torch_dtype(layout.dtype), device=device)
    bits = as_bits(kv)
    info = torch.iinfo(bits.dtype)
    bits.random_(info.min, info.max, generator=torch.Generator(device=device).manual_seed(seed))  # in place: no 2x peak
    return kv


def sentinel_kv(layout: KVLayout, num_tokens: int, device) -> torch.Tensor:
    kv = torch.empty((layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim), dtype=torch_dtype(layout.dtype), device=device)
    kv.view(torch.uint8).fill_(SENTINEL)
    return kv


def round_trip(transfer, client, cases, config: ByteCheckConfig, device) -> tuple[int, int]:
    """Store then load every case; (bytes checked, bytes wrong)."""
    lay = config.layout
    checked = wrong = 0
    for case_index, (_name, first_chunk, offsets) in enumerate(cases):
        capacity = (first_chunk + len(offsets) + 1) * lay.chunk_tokens
        src = random_kv(lay, capacity, config.seed + case_index, device)
        sums = transfer.store(src, first_chunk, offsets)
        for i, offset in enumerate(offsets):
            if sums[i] != page_checksum(client.page(offset, lay.page_bytes)):
                wrong += lay.page_bytes  # a checksum of other bytes than those in the page
        for i in sorted({0, len(offsets) - 1})[: config.reference_pages]:
            t0 = (first_chunk + i) * lay.chunk_tokens
            expected = page_bytes_of(reference_engine_to_pages(src[:, :, :, t0 : t0 + lay.chunk_tokens].cpu(), lay, 0, 1))
            stored = client.page(offsets[i], lay.page_bytes)
            wrong += int((stored != np.frombuffer(expected, dtype=np.uint8)).sum())
            checked += lay.page_bytes
        dst = sentinel_kv(lay, capacity, device)
        headers = [PageHeader(offset=o, page_bytes=lay.page_bytes, checksum=s) for o, s in zip(offsets, sums)]
        handle = transfer.load(dst, first_chunk, headers)
        handle.wait_all()
        t0, t1 = first_chunk * lay.chunk_tokens, (first_chunk + len(offsets)) * lay.chunk_tokens
        wrong += mismatched_bytes(dst[:, :, :, t0:t1], src[:, :, :, t0:t1])
        wrong += bytes_not_sentinel(dst[:, :, :, :t0]) + bytes_not_sentinel(dst[:, :, :, t1:])
        checked += (t1 - t0) * lay.bytes_per_token
    return checked, wrong


def _timed_path(path: str, kind: str, num_cases: int, run) -> PathResult:
    start = time.perf_counter()
    checked, wrong = run()
    return PathResult(path, kind, num_cases, checked, wrong, time.perf_counter() - start)


def run_bytecheck(client, config: ByteCheckConfig = ByteCheckConfig()) -> ByteCheckReport:
    """Run every available path against ``client`` (a connected PoolClient); never raises on a mismatch,
    it reports it (``report.ok``)."""
    lay = config.layout
    extent = int(client.hello.extent_bytes)
    wanted = min(config.max_pages, max(8, extent // lay.page_bytes + 4))
    scratch = reserve_scratch(client, lay.page_bytes, wanted)
    results: list[PathResult] = []
    notes: list[str] = []
    try:
        if len(scratch.offsets) < 2:
            raise RuntimeError(f"the pool has no room for the byte check ({len(scratch.offsets)} pages of {lay.page_bytes} bytes)")
        cases = make_cases(scratch.offsets, extent, config.seed, config.max_run_pages)
        boundaries = count_boundaries(scratch.offsets, extent)
        if not boundaries:
            notes.append(f"note: {len(scratch.offsets)} scratch pages crossed no extent boundary (extent {extent} bytes)")
        tconfig = config.transfer or stress_config(lay)
        with make_transfer(lay, client, "cpu", tconfig) as cpu:
            results.append(_timed_path("cpu", "round_trip", len(cases), lambda: round_trip(cpu, client, cases, config, "cpu")))
        if config.cuda and torch.cuda.is_available():
            from kvshare.transfer.ordercheck import cuda_checks

            device = torch.device("cuda", torch.cuda.current_device())
            results.extend(cuda_checks(client, cases, scratch.offsets, config, tconfig, device))
        elif config.cuda:
            results.append(PathResult("cuda", "round_trip", 0, 0, 0, 0.0, skipped="no CUDA device"))
    finally:
        scratch.release(client)
    return ByteCheckReport(tuple(results), lay, len(scratch.offsets), extent, boundaries, tuple(notes))
