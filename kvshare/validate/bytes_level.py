"""Level 1, bytes: random KV through every transfer path on this machine, stored then loaded, byte for byte.

Wraps ``kvshare.transfer.bytecheck.run_bytecheck`` (cases: a long run in allocation
order, a shifted first chunk, scattered pages, pages around extent = registration
boundaries, a single page) over several page sizes and dtypes: one that divides
the extent and crosses its boundaries, one that does not divide it, a small one.
On CUDA (over the registered arena) each copy method adds the delay-injection
checks: with a sleeping producer the ordered store and the waited load stay exact,
and the deliberately unordered variants must come out wrong ("caught"). The vLLM
connector's GPU path gets the same: a round trip, store-order and load-order with
their controls, for every memory order of vLLM's flash-attention KV
(kvshare.integrations.vllm.ordercheck).
"""

from __future__ import annotations

import time

from kvshare.layout import KVLayout
from kvshare.units import format_bytes
from kvshare.validate.direct_check import direct_rows
from kvshare.validate.report import CAUGHT, FAIL, PASS, SKIP, LevelResult, Row, verdict_of

# (name, layout, max scratch pages; None: enough to cross an extent boundary)
LAYOUTS: tuple[tuple[str, KVLayout, int | None], ...] = (
    ("bf16", KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=32), None),  # 64 KiB
    ("f32", KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=32), 256),  # 96 KiB
    ("f16", KVLayout(num_layers=2, num_kv_heads=1, head_dim=48, dtype="float16", chunk_tokens=32), 256),  # 12 KiB
)


def run_bytes_level(pool, layouts=LAYOUTS) -> LevelResult:
    from kvshare.transfer.bytecheck import run_bytecheck
    from kvshare.transfer.roundtrip import ByteCheckConfig

    started = time.perf_counter()
    rows: list[Row] = []
    paths: set[str] = set()
    figures = {"bytes_checked": 0, "bytes_wrong": 0, "extent_boundaries": 0, "controls_caught": 0, "layouts": {}}
    if pool.is_cuda:
        rows.append(Row("register arena", PASS, pool.register_arena()))  # once, shared by every CUDA transfer
    for name, layout, max_pages in layouts:
        config = ByteCheckConfig(layout=layout, cuda=pool.is_cuda)
        if max_pages is not None:
            config = ByteCheckConfig(layout=layout, cuda=pool.is_cuda, max_pages=max_pages)
        report = run_bytecheck(pool.client, config)
        figures["layouts"][name] = {
            "page_bytes": layout.page_bytes,
            "dtype": layout.dtype,
            "pages": report.num_pages,
            "extent_boundaries": report.extent_boundaries,
            "notes": list(report.notes),
        }
        figures["extent_boundaries"] += report.extent_boundaries
        for r in report.results:
            rows.append(_row(f"{name} {format_bytes(layout.page_bytes)} {r.path}", r))
            _count(r, r.path, figures, paths)
    if pool.is_cuda:
        for r in _vllm_staged_results(pool):  # the vLLM connector's GPU path, every layout, both directions
            rows.append(_row(r.path, r))
            _count(r, r.path.split(" ")[0], figures, paths)
    else:
        rows.append(Row("cuda paths", SKIP, f"device {pool.device}: CUDA paths not run"))
    rows += direct_rows(pool)  # a lease taken with no round trip reads what the pool answers
    status = verdict_of(rows)
    if figures["extent_boundaries"] == 0:
        rows.append(
            Row(
                "extent boundaries",
                FAIL,
                "no case crossed an extent (registration) boundary: the pool is too small or too full for the check",
            )
        )
        status = FAIL
    summary = _summary(figures, paths, len(layouts), pool.is_cuda)
    return LevelResult("bytes", status, summary, rows, figures, time.perf_counter() - started)


def _count(r, path: str, figures: dict, paths: set[str]) -> None:
    """Add one path's result to the level's figures, and ``path`` to the paths run when it was a round trip."""
    figures["bytes_checked"] += r.bytes_checked
    if r.kind == "control":
        figures["controls_caught"] += int(r.caught)
    elif not r.skipped:
        figures["bytes_wrong"] += r.mismatched_bytes
        if r.kind == "round_trip":
            paths.add(path)


def _summary(figures: dict, paths: set[str], num_layouts: int, is_cuda: bool) -> str:
    ordering = (
        f"{figures['controls_caught']} deliberately unordered controls caught"
        if is_cuda
        else "delay/ordering checks need CUDA: skipped"
    )
    return (
        f"{format_bytes(figures['bytes_checked'])} compared, {figures['bytes_wrong']} wrong; "
        f"{num_layouts} page sizes; {figures['extent_boundaries']} extent boundaries crossed; "
        f"paths run: {', '.join(sorted(paths))}; {ordering}"
    )


def _vllm_staged_results(pool) -> list:
    """kvshare.integrations.vllm.ordercheck over the checked pool on its GPU (none if the package is absent)."""
    import torch

    try:
        from kvshare.integrations.vllm.ordercheck import staged_checks
    except ImportError:
        return []
    return staged_checks(pool.client, torch.device(pool.device))


def _row(name: str, r) -> Row:
    figures = {
        "cases": r.num_cases,
        "bytes": r.bytes_checked,
        "wrong": r.mismatched_bytes,
        "seconds": round(r.seconds, 3),
    }
    if r.skipped:
        return Row(name, SKIP, r.skipped)
    if r.kind == "control":
        status = CAUGHT if r.caught else FAIL
        detail = (
            "deliberately unordered variant: wrong bytes seen, so the check can see this bug"
            if r.caught
            else "the deliberately unordered variant came out right: the check cannot see the bug here"
        )
        return Row(name, status, "; ".join(p for p in (detail, r.detail) if p), figures)
    return Row(name, PASS if r.passed else FAIL, r.detail, figures)
