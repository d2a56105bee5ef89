"""The results folder and the unit runner: append, resume, re-run failures, time budget, interrupts."""

from __future__ import annotations

import asyncio
import csv
from types import SimpleNamespace

from kvshare.bench.records import Record, ResultsDir
from kvshare.bench.runner import Unit, past_durations, run_units


def rec(unit: str, run_id: str = "r1", error: str | None = None, e2e: float = 1.0, **kw) -> Record:
    return Record(
        run_id=run_id,
        experiment=unit.split("/")[0],
        unit=unit,
        condition="on",
        role="measure",
        context_tokens=512,
        url="http://x",
        ttft_s=None if error else 0.5,
        e2e_s=e2e,
        error=error,
        token_ids=[1, 2],
        **kw,
    )


def test_append_load_and_csv(tmp_path):
    results = ResultsDir(str(tmp_path))
    results.append([rec("ttft/L=512"), rec("ttft/L=512")])
    loaded = results.load()
    assert len(loaded) == 2 and loaded[0].token_ids == [1, 2] and loaded[0].is_ok
    with open(results.write_csv()) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and "token_ids" not in rows[0] and rows[0]["unit"] == "ttft/L=512"


def test_a_line_cut_short_is_ignored(tmp_path):
    results = ResultsDir(str(tmp_path))
    results.append([rec("ttft/L=512")])
    with open(results.file("records.jsonl"), "a") as f:
        f.write('{"run_id": "r1", "experi')
    assert len(results.load()) == 1


def test_failed_units_are_not_complete_and_a_rerun_replaces_them(tmp_path):
    results = ResultsDir(str(tmp_path))
    results.append([rec("blocks/a"), rec("blocks/b", error="HTTP 500")])
    assert results.completed_units() == {"blocks/a"}
    results.append([rec("blocks/b", run_id="r2")])
    assert results.completed_units() == {"blocks/a", "blocks/b"}
    assert [r.run_id for r in results.load() if r.unit == "blocks/b"] == ["r2"]
    assert len(results.load(latest_only=False)) == 3


def test_the_output_check_round_trips_and_logprobs_stay_out_of_the_csv(tmp_path):
    results = ResultsDir(str(tmp_path))
    r = rec(
        "ttft/L=512",
        top_logprobs=[[-0.1, -0.5], [-0.2, -0.2005]],
        output_check="near-tie",
        first_divergence=1,
        divergence_gap=0.0005,
        reference_token=7,
        output_token=9,
        matches_reference=False,
        compared_with="cold",
    )
    results.append([r])
    (loaded,) = results.load()
    assert loaded == r and loaded.check().verdict == "near-tie"
    with open(results.write_csv()) as f:
        (row,) = csv.DictReader(f)
    assert "top_logprobs" not in row and row["output_check"] == "near-tie" and row["divergence_gap"] == "0.0005"
    assert (row["reference_token"], row["output_token"], row["compared_with"]) == ("7", "9", "cold")


def test_records_of_the_previous_version_load(tmp_path):
    """A line written before the output check: no output_check, gap, tokens or logprobs."""
    results = ResultsDir(str(tmp_path))
    line = (
        '{"run_id": "r0", "experiment": "ttft", "unit": "ttft/L=512", "condition": "local", "role": "measure", '
        '"context_tokens": 512, "url": "http://x", "ttft_s": 0.1, "matches_reference": false, '
        '"first_divergence": 13, "token_ids": [1, 2]}\n'
    )
    with open(results.file("records.jsonl"), "w") as f:
        f.write(line)
    (old,) = results.load()
    assert old.output_check is None and old.top_logprobs is None
    assert (old.check().verdict, old.check().step, old.check().gap) == ("unknown", 13, None)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_unit(key: str, clock: FakeClock, seconds: float, calls: list, error: str | None = None, raise_=None) -> Unit:
    async def run(ctx):
        calls.append(key)
        if raise_ is not None:
            raise raise_
        clock.now += seconds
        return [rec(key, run_id=ctx.run_id, error=error, e2e=seconds)]

    return Unit(key, key.rsplit("/", 1)[0], 1, run)


def ctx_for(tmp_path, run_id="r1"):
    return SimpleNamespace(results=ResultsDir(str(tmp_path)), run_id=run_id, on_request=None)


def test_resume_skips_recorded_units_and_the_time_budget_stops_before_an_overlong_unit(tmp_path):
    clock, calls = FakeClock(), []
    units = [make_unit(f"ttft/k/{i}", clock, 10.0, calls) for i in range(4)]
    # budget 25 s: units 0 and 1 take 20 s; unit 2 would end at 30 s (estimated from units of its kind)
    outcome = asyncio.run(run_units(ctx_for(tmp_path), units, time_budget_s=25.0, clock=clock))
    assert calls == ["ttft/k/0", "ttft/k/1"]
    assert (outcome.num_done, outcome.num_left) == (2, 2) and outcome.stop_reason.startswith("time budget")
    # the next run continues where it stopped, with estimates from the records of the earlier one
    estimates = past_durations(ResultsDir(str(tmp_path)).load(), "ttft", lambda r: r.unit.rsplit("/", 1)[0])
    assert estimates == {"ttft/k": 10.0}
    calls.clear()
    outcome = asyncio.run(run_units(ctx_for(tmp_path, "r2"), units, estimates, time_budget_s=100.0, clock=clock))
    assert calls == ["ttft/k/2", "ttft/k/3"] and outcome.num_skipped == 2 and outcome.stop_reason == "complete"


def test_units_failing_entirely_twice_in_a_row_stop_the_run(tmp_path):
    clock, calls = FakeClock(), []
    units = [make_unit(f"blocks/u/{i}", clock, 1.0, calls, error="connection refused") for i in range(5)]
    outcome = asyncio.run(run_units(ctx_for(tmp_path), units, clock=clock))
    assert calls == ["blocks/u/0", "blocks/u/1"]
    assert "failed entirely" in outcome.stop_reason and "connection refused" in outcome.stop_reason
    assert outcome.num_left == 3


def test_an_interrupt_keeps_completed_units_and_drops_the_current_one(tmp_path):
    clock, calls = FakeClock(), []
    units = [
        make_unit("sessions/a/0", clock, 1.0, calls),
        make_unit("sessions/a/1", clock, 1.0, calls, raise_=KeyboardInterrupt()),
        make_unit("sessions/a/2", clock, 1.0, calls),
    ]
    outcome = asyncio.run(run_units(ctx_for(tmp_path), units, clock=clock))
    assert outcome.stop_reason.startswith("interrupted") and outcome.num_left == 2
    assert ResultsDir(str(tmp_path)).completed_units() == {"sessions/a/0"}


def test_tree_commit_names_a_copied_tree_by_the_environment(monkeypatch):
    """A tree copied without its .git (the GPU machine's) is named by $KVSHARE_COMMIT; here, git names it."""
    from kvshare.bench.records import tree_commit

    monkeypatch.setenv("KVSHARE_COMMIT", "abc1234")
    assert tree_commit() == "abc1234"
    monkeypatch.delenv("KVSHARE_COMMIT")
    named = tree_commit()
    assert named is None or named.split("+")[0] != "abc1234" and len(named.split("+")[0]) >= 7
