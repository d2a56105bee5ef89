"""Run the selected levels of ``kvshare validate`` and collect one report.

Order of execution: full-pool first, then bytes, helpers, service (the report
shows the ladder's order). Pinning the arena for the CUDA byte paths faults every
page in, which would hide the full-pool level's fault-in time; run first, the
full-pool level measures fault-in, then pins the arena once for the whole command.
A level that raises is reported as failed with the exception's message; the
others still run.
"""

from __future__ import annotations

import logging
import time
import traceback
from contextlib import ExitStack
from dataclasses import dataclass

from kvshare.validate.report import DEFAULT_LEVELS, FAIL, LEVELS, LevelResult, ValidateReport

log = logging.getLogger("kvshare.validate")
RUN_ORDER = ("full-pool", "bytes", "helpers", "service", "isolation")
POOL_LEVELS = ("bytes", "full-pool")


@dataclass(frozen=True)
class ValidateConfig:
    levels: tuple[str, ...] = DEFAULT_LEVELS
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    pool: str | None = None  # socket of a running pool; None: start one of pool_size
    pool_size: int = 4 << 30
    extent_size: int = 256 << 20
    page_size: int = 2 << 20  # full-pool level
    threads: int | None = None  # full-pool level; None: min(8, cores)
    progress: bool = True
    # service level
    replicas: tuple[str, ...] = ()  # empty: start a cluster (kvshare up) of num_replicas
    model: str = "tiny"
    num_replicas: int = 2
    service_pool_size: str = "1GiB"
    replica_args: tuple[str, ...] = ()
    max_tokens: int = 16
    chunk_tokens: int = 256
    prompt_lengths: tuple[int, ...] = (256, 300, 512, 777, 1024, 1300)  # completions, in tokens
    num_chat: int = 2
    gap_threshold: float = 1e-3
    request_timeout_s: float = 600.0
    seed: int | None = None

    def __post_init__(self) -> None:
        unknown = [lv for lv in self.levels if lv not in LEVELS]
        if unknown or not self.levels:
            raise ValueError(
                f"unknown level(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(LEVELS)}"
            )
        if self.page_size > self.extent_size:
            raise ValueError(f"--page-size {self.page_size} must not exceed --extent-size {self.extent_size}")


def run_validate(config: ValidateConfig, console=None) -> ValidateReport:
    from kvshare.validate.checked_pool import CheckedPool, PoolSpec, choose_device

    device = choose_device(config.device)
    report = ValidateReport(
        [],
        settings={
            "levels": list(config.levels),
            "device": device,
            "pool": config.pool,
            "pool_size": config.pool_size,
            "extent_size": config.extent_size,
            "page_size": config.page_size,
        },
    )
    selected = [lv for lv in RUN_ORDER if lv in config.levels]
    with ExitStack() as stack:
        pool = None
        if any(lv in POOL_LEVELS for lv in selected):
            pool = stack.enter_context(CheckedPool(PoolSpec(config.pool, config.pool_size, config.extent_size), device))
            report.settings.update(pool_socket=pool.socket, started_pool=pool.started_pool)
        for level in selected:
            _say(console, f"[bold]level {level}[/bold] ...")
            result = _run_level(level, config, pool, device, console)
            report.levels.append(result)
            _say(console, f"level {level}: {result.status} ({result.seconds:.1f} s)")
    return report


def _run_level(level: str, config: ValidateConfig, pool, device: str, console) -> LevelResult:
    started = time.perf_counter()
    try:
        if level == "bytes":
            from kvshare.validate.bytes_level import run_bytes_level

            return run_bytes_level(pool)
        if level == "helpers":
            from kvshare.validate.helpers_level import run_helpers_level

            return run_helpers_level(device)
        if level == "full-pool":
            from kvshare.validate.full_pool_level import run_full_pool_level

            return run_full_pool_level(
                pool, config.page_size, show_progress=config.progress, num_threads=config.threads, console=console
            )
        if level == "isolation":
            from kvshare.validate.isolation import run_isolation_level

            return run_isolation_level(
                config.model,
                device,
                config.service_pool_size,
                ("--chunk-tokens", str(config.chunk_tokens), *config.replica_args),
                config.request_timeout_s,
            )
        from kvshare.validate.service_run import run_service

        return run_service(config, device, console)
    except Exception as exc:  # one level's crash is its failure, not the end of the report
        log.debug("level %s raised:\n%s", level, traceback.format_exc())
        return LevelResult(level, FAIL, error=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - started)


def _say(console, text: str) -> None:
    if console is not None:
        console.print(text)
