"""Level 3, full pool: every page of the pool allocated through the real allocator, written and verified.

Wraps ``check_full_pool`` (the proof itself) with the checked pool's CUDA
registration as its pin step, a rich progress bar, and a LevelResult with the
time of each phase: fault-in, pin (cudaHostRegister of the whole arena in extent
pieces), write, verify. On a pool that is serving, pages leased or written by
others cannot be reserved (committed ones are evicted to make room): run this
level on an idle pool, or let validate start its own.
"""

from __future__ import annotations

import time

from kvshare.units import format_bytes
from kvshare.validate.full_pool import FullPoolResult, check_full_pool
from kvshare.validate.report import FAIL, PASS, SKIP, LevelResult, Row

PHASES = (("fault_in", "fault-in"), ("pin", "pin"), ("write", "write"), ("verify", "verify"))


def run_full_pool_level(
    pool,
    page_bytes: int,
    show_progress: bool = True,
    num_threads: int | None = None,
    console=None,
    corrupt_page: int | None = None,
) -> LevelResult:
    """``corrupt_page``: negative control (flip a byte of that page after writing)."""
    client = pool.client
    extent = int(client.hello.extent_bytes)
    if page_bytes > extent:
        return LevelResult(
            "full-pool",
            FAIL,
            error=f"--page-size {format_bytes(page_bytes)} exceeds the pool's extent "
            f"{format_bytes(extent)}: no page could be allocated",
        )
    before = client.stats()
    started = time.perf_counter()
    pin = (lambda: pool.register_arena(prefault=False)) if pool.is_cuda else None  # fault-in ran just before
    with _progress_bar(console, show_progress) as progress:
        result = check_full_pool(
            client, page_bytes, pin=pin, progress=progress, corrupt_page=corrupt_page, num_threads=num_threads
        )
    seconds = time.perf_counter() - started
    arena = result.arena_bytes
    rows = _rows(result, page_bytes, extent, before)
    status = PASS if result.passed else FAIL
    times = ", ".join(f"{name} {result.seconds[key]:.1f} s" for key, name in PHASES if key in result.seconds)
    summary = f"{format_bytes(arena)} in {result.num_pages} pages of {format_bytes(page_bytes)}: {times}"
    if result.bad_pages:
        summary += f"; {len(result.bad_pages)} bad pages"
    return LevelResult("full-pool", status, summary, rows, _figures(result, page_bytes, extent), seconds)


def _rows(result: FullPoolResult, page_bytes: int, extent: int, before: dict) -> list[Row]:
    """The allocation, each phase's time and bandwidth, and the pages whose pattern was wrong."""
    arena = result.arena_bytes
    rows = []
    for key, name in PHASES:
        if key not in result.seconds:
            rows.append(Row(name, SKIP, "no CUDA device (--device cpu or none found)" if key == "pin" else ""))
            continue
        s = result.seconds[key]
        figures = {"seconds": round(s, 3), "GB/s": round(arena / s / 1e9, 2) if s > 0 else None}
        rows.append(
            Row(
                name,
                PASS if key != "verify" or not result.bad_pages else FAIL,
                result.pinned if key == "pin" else "",
                figures,
            )
        )
    pages_ok = result.num_pages == result.expected_pages and result.num_pages > 0
    detail = f"{result.num_pages} of {result.expected_pages} pages of {format_bytes(page_bytes)} reserved"
    if not pages_ok and before.get("used_bytes"):
        detail += f" (the pool held {format_bytes(before['used_bytes'])} before: not idle)"
    rows.insert(
        0,
        Row(
            "allocate",
            PASS if pages_ok else FAIL,
            detail,
            {"arena": format_bytes(arena), "extent": format_bytes(extent)},
        ),
    )
    if result.bad_pages:
        rows.append(Row("pattern", FAIL, f"{len(result.bad_pages)} pages wrong, first {result.bad_pages[:8]}"))
    return rows


def _figures(result: FullPoolResult, page_bytes: int, extent: int) -> dict:
    """The level's figures for the JSON report."""
    arena = result.arena_bytes
    return {
        "arena_bytes": arena,
        "page_bytes": page_bytes,
        "extent_bytes": extent,
        "num_pages": result.num_pages,
        "expected_pages": result.expected_pages,
        "bad_pages": result.bad_pages[:64],
        "seconds": {k: round(v, 3) for k, v in result.seconds.items()},
        "pinned": result.pinned,
    }


class _progress_bar:
    """A rich progress bar with one task per phase; a no-op callback when disabled."""

    def __init__(self, console, enabled: bool) -> None:
        self.enabled = enabled
        self.console = console
        self._progress = None
        self._tasks: dict[str, int] = {}

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("full-pool {task.description:>8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._progress.start()
        return self.update

    def update(self, phase: str, done: int, total: int) -> None:
        if phase not in self._tasks:
            self._tasks[phase] = self._progress.add_task(phase, total=total)
        self._progress.update(self._tasks[phase], completed=done)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
