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

One round trip and its checks are ``roundtrip.py``'s; on CUDA, ``ordercheck`` adds the
delay-injection checks (see there). Scratch pages are reserved under throwaway keys and
aborted: nothing becomes visible.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from kvshare.layout import KVLayout
from kvshare.transfer.base import TransferConfig
from kvshare.transfer.factory import make_transfer
from kvshare.transfer.ordercheck import cuda_checks
from kvshare.transfer.roundtrip import ByteCheckConfig, PathResult, round_trip
from kvshare.transfer.scratch import reserve_scratch


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
            verdict = (
                f"skipped: {r.skipped}"
                if r.skipped
                else ("caught" if r.kind == "control" and r.caught else "ok" if r.passed else "FAIL")
            )
            rows.append(
                f"{r.path:34} {r.kind:10} {r.num_cases:>5} {r.bytes_checked:>12} {r.mismatched_bytes:>12} "
                f"{r.seconds:>7.3f}  {verdict}"
            )
        return "\n".join(rows + list(self.notes))


def stress_config(layout: KVLayout) -> TransferConfig:
    """One layer per group and three pages per unit: many units, both staging buffers, every seam."""
    return TransferConfig(min_copy_bytes=layout.layer_bytes, staging_bytes=3 * layout.layer_bytes, verify_fraction=1.0)


def make_cases(
    offsets: list[int], extent_bytes: int, seed: int, max_run_pages: int = 64
) -> list[tuple[str, int, list[int]]]:
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
            raise RuntimeError(
                f"the pool has no room for the byte check ({len(scratch.offsets)} pages of {lay.page_bytes} bytes)"
            )
        cases = make_cases(scratch.offsets, extent, config.seed, config.max_run_pages)
        boundaries = count_boundaries(scratch.offsets, extent)
        if not boundaries:
            notes.append(
                f"note: {len(scratch.offsets)} scratch pages crossed no extent boundary (extent {extent} bytes)"
            )
        tconfig = config.transfer or stress_config(lay)
        with make_transfer(lay, client, "cpu", tconfig) as cpu:
            results.append(
                _timed_path("cpu", "round_trip", len(cases), lambda: round_trip(cpu, client, cases, config, "cpu"))
            )
        if config.cuda and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
            results.extend(cuda_checks(client, cases, scratch.offsets, config, tconfig, device))
        elif config.cuda:
            results.append(PathResult("cuda", "round_trip", 0, 0, 0, 0.0, skipped="no CUDA device"))
    finally:
        scratch.release(client)
    return ByteCheckReport(tuple(results), lay, len(scratch.offsets), extent, boundaries, tuple(notes))
