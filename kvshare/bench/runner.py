"""Running an experiment's units: resume, a time budget, progress, and one request -> one record.

An experiment is a list of ``Unit``s (requests that belong together). The runner skips
units the results folder already holds, runs the others one at a time, appends each
unit's records when it completes, and stops cleanly on Ctrl-C or when the next unit
would not finish within the time budget (estimated from units of the same kind that
ran before, in this run or an earlier one). Run the same command again to continue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from kvshare.bench.client import BenchRequest, Response, send
from kvshare.bench.records import Record, ResultsDir, output_digest
from kvshare.outputs import check_outputs


@dataclass
class BenchContext:
    """What every experiment uses: endpoints, the model's name, prompts, where records go."""

    run_id: str
    session: aiohttp.ClientSession
    replicas: Any  # FixedReplicas | SequentialReplicas
    model: str
    factory: Any  # PromptFactory
    results: ResultsDir
    off_replicas: Any = None  # OFF requests go here (no request extension) when pool on/off are two clusters
    use_extension: bool = True  # send {"kvshare": {...}} (kvshare replicas; not plain vLLM servers)
    timeout_s: float = 3600.0
    on_request: Callable[[str], None] | None = None  # progress callback, given a short description
    timeline: bool = False  # ask for each request's timeline where the extension is sent

    def replica_for(self, index: int, use_pool: bool) -> tuple[str, bool | None]:
        """(URL, use_pool to send) of replica ``index`` for a request with the pool on or off."""
        if not use_pool and self.off_replicas is not None:
            return self.off_replicas.activate(index % self.off_replicas.num_replicas), None
        return self.replicas.activate(index % self.replicas.num_replicas), use_pool if self.use_extension else None

    async def measure(self, request: BenchRequest, **fields: Any) -> Record:
        """Send ``request`` and turn the response into a record carrying ``fields``."""
        return (await self.exchange(request, **fields))[0]

    async def exchange(self, request: BenchRequest, **fields: Any) -> tuple[Record, Response]:
        """Send ``request``: its record (carrying ``fields``) and the response itself."""
        if self.on_request is not None:
            self.on_request(
                f"{fields.get('experiment')} {fields.get('condition')} {fields.get('role')} "
                f"L={fields.get('context_tokens')}"
            )
        if self.timeline and request.use_pool is not None:
            request = replace(request, timeline=True)
        started_at = time.time()
        response = await send(self.session, request, self.timeout_s)
        return to_record(response, request, run_id=self.run_id, started_at=started_at, **fields), response


def to_record(response: Response, request: BenchRequest, **fields: Any) -> Record:
    p = response.provenance or {}
    prompt_tokens = response.prompt_tokens
    if prompt_tokens is None and request.prompt is not None:
        prompt_tokens = len(request.prompt)
    return Record(
        url=request.url,
        prompt_tokens=prompt_tokens,
        completion_tokens=response.completion_tokens,
        use_pool=request.use_pool,
        replica=p.get("replica") or response.routed_to or request.url,
        ttft_s=response.ttft_s,
        first_text_s=response.first_text_s,
        first_chunk_s=response.first_chunk_s,
        e2e_s=response.e2e_s,
        local_tokens=p.get("local_tokens"),
        pool_tokens=p.get("pool_tokens"),
        computed_tokens=p.get("computed_tokens"),
        cached_tokens=response.cached_tokens,
        pool_kv_bytes=p.get("pool_kv_bytes"),
        pool_state_bytes=p.get("pool_state_bytes", 0 if p else None),
        deterministic=p.get("deterministic"),
        output_digest=output_digest(response.token_ids),
        error=response.error,
        token_ids=response.token_ids,
        top_logprobs=response.top_logprobs or None,
        timeline=p.get("timeline"),
        **fields,
    )


def mark_matches(records: list[Record], reference: Record | None) -> None:
    """Check every record's output against ``reference``'s (kvshare.outputs) and record the verdict:
    equal, or where they part, the reference's top-2 gap there and the two tokens. Two outputs of replicas
    in the deterministic mode are held to the exact rule (ids and logprobs equal), others to the gap rule."""
    if reference is None:
        return
    # name the reference as the tables do: the cold request (ttft), a prime or a verify recompute
    compared_with = reference.condition if reference.role == "measure" else reference.role
    for r in records:
        if r is not reference:
            is_exact = reference.deterministic is True and r.deterministic is True
            r.set_check(
                check_outputs(
                    reference.token_ids,
                    r.token_ids,
                    reference.top_logprobs,
                    output_top_logprobs=r.top_logprobs,
                    is_exact=is_exact,
                ),
                compared_with,
            )


MAX_FAILED_UNITS_IN_A_ROW = 2  # then the endpoints are broken: stop rather than record failures


@dataclass(frozen=True)
class Unit:
    key: str  # unique within the experiment; recorded, so a resumed run skips it
    kind: str  # units of one kind take about as long (the time budget estimates from them)
    num_requests: int
    run: Callable[[BenchContext], Awaitable[list[Record]]]


@dataclass
class RunOutcome:
    num_done: int = 0  # units run now
    num_skipped: int = 0  # units recorded by an earlier run
    num_left: int = 0  # units not run (time budget, interrupt)
    stop_reason: str = "complete"
    durations: dict[str, float] = field(default_factory=dict)


def past_durations(records: list[Record], experiment: str, kind_of: Callable[[Record], str]) -> dict[str, float]:
    """Longest recorded unit time per kind (sum of its requests' e2e times; replica starts not included)."""
    per_unit: dict[str, tuple[str, float]] = {}
    for r in records:
        if r.experiment == experiment:
            kind, total = per_unit.get(r.unit, (kind_of(r), 0.0))
            per_unit[r.unit] = (kind, total + (r.e2e_s or 0.0))
    longest: dict[str, float] = {}
    for kind, total in per_unit.values():
        longest[kind] = max(longest.get(kind, 0.0), total)
    return longest


async def run_units(
    ctx: BenchContext,
    units: list[Unit],
    estimates: dict[str, float] | None = None,
    time_budget_s: float | None = None,
    progress: Any = None,
    clock: Callable[[], float] = time.monotonic,
    on_unit: Callable[[str, float, list[Record]], None] | None = None,
) -> RunOutcome:
    """Run the units not yet recorded, in order; see the module docstring."""
    done = ctx.results.completed_units()
    todo = [u for u in units if u.key not in done]
    outcome = RunOutcome(num_skipped=len(units) - len(todo))
    estimates = dict(estimates or {})
    started = clock()
    num_failed_in_a_row = 0
    task = progress.add_task("measuring", total=sum(u.num_requests for u in todo)) if progress is not None else None
    if progress is not None:
        ctx.on_request = lambda text: progress.update(task, description=text)
    for i, unit in enumerate(todo):
        elapsed = clock() - started
        estimate = estimates.get(unit.kind)
        if time_budget_s is not None and estimate is not None and elapsed + estimate > time_budget_s:
            outcome.num_left, outcome.stop_reason = (
                len(todo) - i,
                (
                    f"time budget: {elapsed:.0f} s used of {time_budget_s:.0f} s and the next unit ({unit.key}) "
                    f"takes about {estimate:.0f} s; run the same command again to continue"
                ),
            )
            break
        unit_started = clock()
        try:
            records = await unit.run(ctx)
        except (KeyboardInterrupt, asyncio.CancelledError):
            outcome.num_left, outcome.stop_reason = len(todo) - i, "interrupted; run the same command again to continue"
            break
        ctx.results.append(records)
        failures = [r.error for r in records if r.error is not None]
        num_failed_in_a_row = num_failed_in_a_row + 1 if records and len(failures) == len(records) else 0
        if num_failed_in_a_row >= MAX_FAILED_UNITS_IN_A_ROW:
            outcome.num_done += 1
            outcome.num_left, outcome.stop_reason = (
                len(todo) - i - 1,
                (f"{num_failed_in_a_row} units in a row failed entirely; the last error: {failures[-1]}"),
            )
            break
        took = clock() - unit_started
        outcome.durations[unit.key] = took
        estimates[unit.kind] = max(estimates.get(unit.kind, 0.0), took)
        outcome.num_done += 1
        if progress is not None:
            progress.advance(task, unit.num_requests)
        if on_unit is not None:
            on_unit(unit.key, took, records)
    return outcome
