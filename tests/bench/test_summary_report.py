"""Tables from synthetic records with known answers; the report and plots are written."""

from __future__ import annotations

import os

import pytest

from kvshare.bench.records import Record, ResultsDir
from kvshare.bench.report import tables, write_report
from kvshare.bench.summary import blocks_rows, sessions_rows, ttft_rows


def r(experiment, condition, ttft, context=128_000, role="measure", **kw) -> Record:
    defaults = dict(
        run_id="r",
        unit=f"{experiment}/{kw.get('block', kw.get('session', 0))}/{condition}",
        url="http://x",
        e2e_s=ttft + 0.5,
    )
    defaults.update(kw)
    return Record(
        experiment=experiment, condition=condition, role=role, context_tokens=context, ttft_s=ttft, **defaults
    )


def blocks_records(context=128_000):
    out = []
    design = [
        ("off", [30.0, 32.0, 34.0]),
        ("on", [0.6, 0.7, 0.5]),
        ("on", [0.6, 0.8, 0.6]),
        ("off", [31.0, 30.0, 40.0]),
    ]
    for b, (condition, times) in enumerate(design):
        for i, t in enumerate(times):
            if condition == "on":
                out.append(r("blocks", condition, 30.0, context, role="prime", block=b, position=i))
            out.append(
                r(
                    "blocks",
                    condition,
                    t,
                    context,
                    block=b,
                    position=i,
                    pool_tokens=127_744 if condition == "on" else 0,
                    matches_reference=True if condition == "on" else None,
                )
            )
    return out


def test_blocks_row_medians_pairs_and_ratio():
    (row,) = blocks_rows(blocks_records())
    assert row.off.median == pytest.approx(31.5)  # median of 30, 32, 34, 31, 30, 40
    assert row.on.median == pytest.approx(0.6)
    assert row.off.ci is not None and row.on.ci is not None  # six values each
    assert row.num_pairs == 6
    # pairs: (30,.6) (32,.7) (34,.5) from OFF#0/ON#0, (31,.6) (30,.8) (40,.6) from OFF#1/ON#1
    ratios = sorted([0.6 / 30, 0.7 / 32, 0.5 / 34, 0.6 / 31, 0.8 / 30, 0.6 / 40])
    assert row.ratio.median == pytest.approx((ratios[2] + ratios[3]) / 2)
    assert row.speedup == pytest.approx(31.5 / 0.6)
    assert row.min_on_pool_tokens == 127_744 and row.num_failed == 0
    assert str(row.outputs) == "equal 6/6; near-tie 0; mismatch 0"


def test_failed_requests_are_counted_not_measured():
    records = blocks_records()
    records.append(r("blocks", "off", 1.0, block=3, position=3, error="HTTP 500"))
    records[-1].ttft_s = None
    (row,) = blocks_rows(records)
    assert row.num_failed == 1 and row.off.n == 6


def test_ttft_row():
    records = [
        r("ttft", "cold", 8.0, 32_000),
        r("ttft", "local", 0.2, 32_000, matches_reference=True),
        r("ttft", "cross", 0.4, 32_000, pool_tokens=31_744, matches_reference=True),
        r("ttft", "cold", 10.0, 32_000),
        r("ttft", "cross", 0.6, 32_000, pool_tokens=31_744, matches_reference=False),
    ]
    (row,) = ttft_rows(records)
    assert row.medians == {"cold": 9.0, "local": 0.2, "cross": 0.5}
    assert row.cross_speedup == pytest.approx(18.0) and row.cross_pool_tokens == 31_744
    # written without an output check (the previous version): the difference's gap is unknown
    assert str(row.outputs) == "equal 2/3; near-tie 0; mismatch 0; gap unknown 1 (step unknown)"


def sessions_records():
    out = []
    # alternate: OFF sessions take 10 + 10 (turn 1 recomputes) + 1; ON: 10 + 1 + 1
    for pool, turns in (("off", [10.0, 10.0, 1.0]), ("on", [10.0, 1.0, 1.0])):
        for s in range(2):
            for t, ttft in enumerate(turns):
                out.append(
                    r(
                        "sessions",
                        f"alternate/{pool}",
                        ttft,
                        32_000,
                        session=s,
                        turn=t,
                        placement="alternate",
                        e2e_s=ttft,
                    )
                )
    for pool in ("off", "on"):
        for t, ttft in enumerate([10.0, 1.0, 1.0]):
            out.append(r("sessions", f"sticky/{pool}", ttft, 32_000, session=0, turn=t, placement="sticky", e2e_s=ttft))
    return out


def test_sessions_rows():
    rows = {row.placement: row for row in sessions_rows(sessions_records())}
    alt, sticky = rows["alternate"], rows["sticky"]
    assert alt.session_s == {"off": 21.0, "on": 12.0}
    assert alt.improvement == pytest.approx(1 - 12 / 21)
    assert alt.turn_ttft["off"] == [10.0, 10.0, 1.0] and alt.num_sessions == {"off": 2, "on": 2}
    assert sticky.improvement == pytest.approx(0.0)


def test_report_tables_study_figures_and_plots_are_written(tmp_path):
    results = ResultsDir(str(tmp_path))
    results.append(
        blocks_records()
        + sessions_records()
        + [r("ttft", "cold", 8.0, 32_000), r("ttft", "cross", 0.4, 32_000, pool_tokens=31_744)]
    )
    results.log_run({"run_id": "r", "experiment": "blocks", "model": "m", "endpoints": {}, "stop_reason": "complete"})
    path, tables_ = write_report(results)
    text = open(path).read()
    for title in ("TTFT", "Blocked design", "Multi-turn sessions", "Per-turn TTFT", "Beside the study"):
        assert title in text
    assert "31.715 s -> 0.605 s" in text and "92.047 s -> 0.790 s" in text
    assert "31.500 s -> 0.600 s" in text  # the measured 128k figure beside the study's
    assert "~35% faster" in text and "43% at 32k" in text  # 1 - 12/21
    for png in ("ttft_by_context.png", "session_turns.png"):
        assert os.path.getsize(tmp_path / png) > 1000 and f"]({png})" in text
    assert os.path.exists(tmp_path / "records.csv")


def test_tables_of_no_records_hold_only_the_study():
    (study,) = tables([])
    assert study.title.startswith("Beside the study") and all(row[2] == "not measured" for row in study.rows)


def test_divergences_are_counted_per_row_and_listed_one_by_one():
    near = dict(
        output_check="near-tie",
        matches_reference=False,
        first_divergence=4,
        divergence_gap=4e-4,
        reference_token=11,
        output_token=12,
        compared_with="cold",
    )
    bad = dict(
        output_check="mismatch",
        matches_reference=False,
        first_divergence=5,
        divergence_gap=0.031,
        reference_token=21,
        output_token=22,
        compared_with="cold",
    )
    equal = dict(output_check="equal", matches_reference=True, compared_with="cold")
    records = [
        r("ttft", "cold", 8.0, 32_000, position=0),
        r("ttft", "local", 0.2, 32_000, position=0, **equal),
        r("ttft", "cross", 0.4, 32_000, position=0, **near),
        r("ttft", "cold", 8.0, 32_000, position=1),
        r("ttft", "local", 0.2, 32_000, position=1, **equal),
        r("ttft", "cross", 0.4, 32_000, position=1, **bad),
    ]
    (row,) = ttft_rows(records)
    assert str(row.outputs) == "equal 2/4; near-tie 1 (step 4, gap 0.0004); mismatch 1 (step 5, gap 0.031)"
    by_title = {t.title: t for t in tables(records)}
    table = by_title["Outputs that part from their reference"]
    assert table.rows == (
        ("ttft", "32k", "cross", "measure #0", "cold", "4", "0.0004", "near tie (allowed)", "11", "12"),
        ("ttft", "32k", "cross", "measure #1", "cold", "5", "0.031", "MISMATCH", "21", "22"),
    )


def test_no_divergence_table_when_every_output_is_equal():
    records = [
        r("ttft", "cold", 8.0, 32_000),
        r("ttft", "cross", 0.4, 32_000, output_check="equal", matches_reference=True),
    ]
    assert all(not t.title.startswith("Outputs that part") for t in tables(records))


def test_the_h200_results_of_the_previous_version_still_render(tmp_path):
    """docs/results/2026-11-29-cabf0e2-h200-transfer-engine-bench/bench was written before the output check: its
    differences render with the gap unknown."""
    import shutil

    source = os.path.join(
        os.path.dirname(__file__),
        "..",
        "..",
        "docs",
        "results",
        "2026-11-29-cabf0e2-h200-transfer-engine-bench",
        "bench",
        "records.jsonl",
    )
    shutil.copy(source, tmp_path / "records.jsonl")
    path, tables_ = write_report(ResultsDir(str(tmp_path)))
    text = open(path).read()
    assert "equal 3/4; near-tie 0; mismatch 0; gap unknown 1 (step 13)" in text  # ttft at 32k
    assert "| sessions | 32k | alternate/on | session 0 turn 5 | - | 22 | unknown | gap unknown | - | - |" in text


def test_blocks_summary_line_shows_how_much_of_the_prompt_the_pool_held():
    from kvshare.bench.report import summary_lines

    (line,) = [line for line in summary_lines(blocks_records()) if line.startswith("blocks")]
    assert "min ON pool tokens 127744 of 128000" in line
    # a pool too small for a block's primes shows up in the line (the 32k blocks of 2026-12-02: 18176 of 32000)
    short = [
        r if r.pool_tokens != 127_744 else r.__class__(**{**r.__dict__, "pool_tokens": 72_704})
        for r in blocks_records()
    ]
    (line,) = [line for line in summary_lines(short) if line.startswith("blocks")]
    assert "min ON pool tokens 72704 of 128000" in line


def test_the_console_tables_say_which_study_and_show_text_columns_only_for_text_rows():
    """Fails when the console's last table cites "the study's published figures" without saying which study (its
    note was left out of the console), or the TTFT table carries a "text adds" column of dashes where no request
    was sent as text."""
    import io

    from rich.console import Console

    from kvshare.bench.report import print_tables

    out = io.StringIO()
    ttft = [r("ttft", "cold", 8.0, 32_000), r("ttft", "cross", 0.4, 32_000, pool_tokens=31_744)]
    tables_ = tables(ttft)
    print_tables(tables_, Console(file=out, width=200))
    printed = " ".join(out.getvalue().split())
    assert "two single-GPU replicas of a 27B model" in printed and "256 GiB host-memory KV pool" in printed, printed
    assert "text adds" not in printed and all("text adds" not in h for h in tables_[0].headers)


def test_a_report_prints_no_line_of_matplotlibs_own(tmp_path):
    """Fails when matplotlib's INFO lines (its font cache, built on first use) reach kvshare's stderr at the
    default log level: they say nothing about the run."""
    import subprocess
    import sys

    ResultsDir(str(tmp_path / "results")).append(
        [r("ttft", "cold", 8.0, 32_000), r("ttft", "cross", 0.4, 32_000, pool_tokens=31_744)]
    )
    env = {**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")}  # an empty matplotlib cache: it builds one
    done = subprocess.run(
        [sys.executable, "-m", "kvshare", "bench", "report", "--out", str(tmp_path / "results")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert os.path.exists(tmp_path / "results" / "ttft_by_context.png")
    assert "matplotlib" not in done.stderr, done.stderr
