"""Run experiments against replicas and write the results folder: the entry point of CLI and demo.

    harness = Harness(HarnessConfig(out_dir="results/bench"), FixedReplicas([url_a, url_b]))
    outcome = harness.run([TTFTConfig(contexts=(1024,)), BlocksConfig(contexts=(1024,), per_block=2)])

Experiments run one after the other in one event loop and one HTTP client session
(no keep-alive: a replica restarted on the same port must not see stale connections).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvshare.bench import blocks, sessions, ttft
from kvshare.bench.records import Record, ResultsDir
from kvshare.bench.report import Table, write_report
from kvshare.bench.runner import BenchContext, RunOutcome, past_durations, run_units

if TYPE_CHECKING:
    import aiohttp

EXPERIMENTS = {ttft.TTFTConfig: ttft, blocks.BlocksConfig: blocks, sessions.SessionsConfig: sessions}


@dataclass(frozen=True)
class HarnessConfig:
    out_dir: str
    tokenizer: str | None = None  # a model directory or preset; default: the served model's name
    system_tokens: int = 0  # shared system prompt before every prompt's unique head
    seed: int = 0
    time_budget_s: float | None = None  # stop before a unit that would end past this (run again to continue)
    unit_allowance_s: float = 0.0  # added to unit estimates taken from earlier runs (e.g. replica start-up)
    timeout_s: float = 3600.0  # per request
    use_extension: bool = True  # send the kvshare request extension (pool on/off per request)
    timeline: bool = False  # ask kvshare replicas for each request's timeline (in the extension; records keep it)
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError("the time budget must be positive")


@dataclass
class HarnessOutcome:
    runs: dict[str, RunOutcome] = field(default_factory=dict)  # experiment -> what ran
    report_path: str = ""
    tables: list[Table] = field(default_factory=list)
    interrupted: bool = False

    @property
    def is_complete(self) -> bool:
        return not self.interrupted and all(r.stop_reason == "complete" for r in self.runs.values())


def record_kind(r: Record) -> str:
    """The unit kind a record belongs to (as the experiments name their units' kinds)."""
    if r.experiment == "ttft":
        return r.unit  # a ttft unit is its own kind: ttft/L=N, ttft/text/L=N
    return f"{r.experiment}/L={r.context_tokens}/{r.condition}"


class Harness:
    def __init__(self, config: HarnessConfig, replicas: Any, off_replicas: Any = None, console: Any = None) -> None:
        self.config = config
        self.replicas = replicas
        self.off_replicas = off_replicas
        self.results = ResultsDir(config.out_dir)
        self.console = console

    def run(self, experiments: list[Any]) -> HarnessOutcome:
        """Run the experiments (configs) in order; Ctrl-C stops after writing what was measured."""
        outcome = HarnessOutcome()
        try:
            asyncio.run(self._run(experiments, outcome))
        except KeyboardInterrupt:
            outcome.interrupted = True
        if not outcome.report_path:
            outcome.report_path, outcome.tables = write_report(self.results)
        return outcome

    async def _run(self, experiments: list[Any], outcome: HarnessOutcome) -> None:
        import aiohttp

        run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        started = time.monotonic()
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            ctx = await self._context(session, run_id)
            with self._progress() as progress:
                for config in experiments:
                    result = await self._run_experiment(ctx, config, progress, started)
                    outcome.runs[EXPERIMENTS[type(config)].EXPERIMENT] = result
                    if result.stop_reason != "complete":
                        break
        outcome.report_path, outcome.tables = write_report(self.results)

    async def _context(self, session: aiohttp.ClientSession, run_id: str) -> BenchContext:
        """The context of this run's experiments: the served model's name and a prompt factory of its tokenizer."""
        from kvshare.bench.client import model_name
        from kvshare.bench.workload import PromptFactory, WorkloadConfig
        from kvshare.engine.loader import load_tokenizer

        # a sequential set knows its model's name: asking a replica would start one the first unit may not need
        model = getattr(self.replicas, "served_name", None) or await model_name(session, self.replicas.activate(0))
        factory = PromptFactory(
            load_tokenizer(self.config.tokenizer or model),
            WorkloadConfig(nonce=run_id, system_tokens=self.config.system_tokens, seed=self.config.seed),
        )
        return BenchContext(
            run_id,
            session,
            self.replicas,
            model,
            factory,
            self.results,
            self.off_replicas,
            self.config.use_extension,
            self.config.timeout_s,
            timeline=self.config.timeline,
        )

    async def _run_experiment(self, ctx: BenchContext, config: Any, progress: Any, started: float) -> RunOutcome:
        """Run one experiment's units not yet recorded, within what is left of the time budget, and log the run."""
        module = EXPERIMENTS[type(config)]
        units = module.units(config, self.replicas.num_replicas)
        estimates = {
            k: v + self.config.unit_allowance_s
            for k, v in past_durations(self.results.load(), module.EXPERIMENT, record_kind).items()
        }
        budget = None
        if self.config.time_budget_s is not None:
            budget = max(self.config.time_budget_s - (time.monotonic() - started), 1e-3)
        t0 = time.time()
        result = await run_units(
            ctx,
            units,
            estimates,
            budget,
            progress,
            on_unit=None if progress is not None else self._log_unit,
        )
        self.results.log_run(
            {
                "run_id": ctx.run_id,
                "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
                "experiment": module.EXPERIMENT,
                "model": ctx.model,
                "endpoints": self._endpoints(),
                "config": _plain(config),
                "harness": _plain(self.config),
                "user_client": _user_client(),
                "seconds": round(time.time() - t0, 1),
                "units_done": result.num_done,
                "units_skipped": result.num_skipped,
                "units_left": result.num_left,
                "stop_reason": result.stop_reason,
            }
        )
        return result

    def _log_unit(self, key: str, seconds: float, records: list[Record]) -> None:
        """One line per unit when there is no progress bar (logs of long runs)."""
        from kvshare.bench.summary import outputs_of
        from kvshare.stats import median

        ttfts = [r.ttft_s for r in records if r.is_ok and r.role == "measure"]
        failed = sum(not r.is_ok for r in records)
        outputs = outputs_of(records)
        line = (
            f"{time.strftime('%H:%M:%S')} {key}: {len(records)} requests in {seconds:.1f} s"
            + (f", median TTFT {median(ttfts):.3f} s" if ttfts else "")
            + (f", {failed} FAILED" if failed else "")
            + (f", outputs {outputs}" if outputs.num_equal < outputs.num_compared else "")
        )
        if self.console is not None:
            self.console.print(line, highlight=False)
        else:
            print(line, flush=True)

    def _endpoints(self) -> dict:
        info = {"replicas": self.replicas.describe()}
        if self.off_replicas is not None:
            info["off_replicas"] = self.off_replicas.describe()
        return info

    def _progress(self):
        import contextlib

        if not self.config.show_progress:
            return contextlib.nullcontext(None)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        return Progress(
            TextColumn("{task.description:<40}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )


def _user_client() -> str:
    """What sends a user's text requests (kvshare.bench.client)."""
    from kvshare.bench.client import openai_version

    version = openai_version()
    return f"openai {version}" if version else "aiohttp"


def _plain(config: Any) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
