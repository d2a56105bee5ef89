"""report.md and console tables from the records: one set of tables, rendered twice."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvshare.bench.records import Record, ResultsDir
from kvshare.bench.summary import (
    STUDY_BLOCKS,
    STUDY_BLOCKS_REQUESTS,
    STUDY_SESSIONS,
    blocks_rows,
    divergences,
    format_ci,
    nearest,
    sessions_rows,
    ttft_rows,
)
from kvshare.outputs import MISMATCH, NEAR_TIE, UNKNOWN
from kvshare.stats import MIN_N_FOR_CI


@dataclass(frozen=True)
class Table:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""


def _s(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _overheads(overheads: dict[str, float | None] | None) -> str:
    if overheads is None:
        return "-"
    return " / ".join(
        "-" if overheads.get(c) is None else f"{100 * overheads[c]:+.1f}%" for c in ("cold", "local", "cross")
    )


def _tokens(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def ttft_table(ttft: list) -> Table:
    """Cold, local and cross-replica TTFT per context and client; the text column only where a text row is."""
    has_text = any(r.text_overheads is not None for r in ttft)
    headers = ("context", "client", "cold s", "local s", "cross s", "cold/cross")
    headers += ("text adds (cold/local/cross)",) if has_text else ()
    rows = tuple(
        (_tokens(r.context), r.client, _s(r.medians["cold"]), _s(r.medians["local"]), _s(r.medians["cross"]))
        + (_x(r.cross_speedup),)
        + ((_overheads(r.text_overheads),) if has_text else ())
        + ("-" if r.cross_pool_tokens is None else str(r.cross_pool_tokens), str(r.outputs))
        + (str(r.counts["cross"]), str(r.num_failed))
        for r in ttft
    )
    text = (
        "text adds: the median of each text request's TTFT over its pair's as token ids, minus 1. " if has_text else ""
    )
    return Table(
        "TTFT: cold, local reuse (same replica), cross-replica reuse (pool)",
        headers + ("pool tokens (cross)", "outputs", "n", "failed"),
        rows,
        "Medians of time to first content token (client side, streamed). Client: token_ids (prompt ids to "
        "/v1/completions, encoded before the clock) or text (chat text through a user's client, encoded inside "
        f"the clock); {text}Outputs: token ids of local and cross requests against the cold request's (see the "
        "divergence table for any that part).",
    )


def tables(records: list[Record]) -> list[Table]:
    out = []
    ttft = ttft_rows(records)
    if ttft:
        out.append(ttft_table(ttft))
    blocks = blocks_rows(records)
    if blocks:
        out.append(blocks_table(blocks))
    sessions = sessions_rows(records)
    if sessions:
        out.append(sessions_table(sessions))
        out.append(turn_ttft_table(sessions))
    parted = divergences(records)
    if parted:
        out.append(divergence_table(parted))
    out.append(study_table(blocks, sessions))
    return out


def blocks_table(blocks: list) -> Table:
    return Table(
        "Blocked design: cross-replica TTFT, pool OFF vs ON (OFF-ON-ON-OFF)",
        (
            "context",
            "n OFF",
            "OFF median s",
            "OFF 95% CI",
            "n ON",
            "ON median s",
            "ON 95% CI",
            "paired ON/OFF",
            "ratio 95% CI",
            "speedup",
            "min pool tokens (ON)",
            "outputs",
            "failed",
        ),
        tuple(
            (
                _tokens(r.context),
                str(r.off.n if r.off else 0),
                _s(r.off.median if r.off else None),
                format_ci(r.off.ci if r.off else None),
                str(r.on.n if r.on else 0),
                _s(r.on.median if r.on else None),
                format_ci(r.on.ci if r.on else None),
                _s(r.ratio.median if r.ratio else None, 4),
                format_ci(r.ratio.ci if r.ratio else None),
                _x(r.speedup),
                "-" if r.min_on_pool_tokens is None else str(r.min_on_pool_tokens),
                str(r.outputs),
                str(r.num_failed),
            )
            for r in blocks
        ),
        f"Primed on replica A, measured on replica B. Bootstrap 95% intervals of the median (fixed seed) "
        f"where a condition has at least {MIN_N_FOR_CI} requests. Paired ratio: median over positions of "
        f"ON/OFF, the k-th OFF block paired with the k-th ON block. "
        f"Outputs: measured ON token ids (and the primes') "
        f"against a recompute of the same prompt.",
    )


def sessions_table(sessions: list) -> Table:
    return Table(
        "Multi-turn sessions: total session time, pool OFF vs ON",
        (
            "initial context",
            "placement",
            "sessions OFF/ON",
            "session OFF s",
            "session ON s",
            "ON faster by",
            "outputs",
            "failed",
        ),
        tuple(
            (
                _tokens(r.context),
                r.placement,
                f"{r.num_sessions['off']}/{r.num_sessions['on']}",
                _s(r.session_s["off"], 2),
                _s(r.session_s["on"], 2),
                _pct(r.improvement),
                str(r.outputs),
                str(r.num_failed),
            )
            for r in sessions
        ),
        "Session time: sum of the turns' end-to-end times (median over sessions). Outputs: the last turn of "
        "verified ON sessions against a recompute.",
    )


def turn_ttft_table(sessions: list) -> Table:
    num_turns = max(len(t) for r in sessions for t in r.turn_ttft.values())
    return Table(
        "Per-turn TTFT (median, seconds)",
        ("initial context", "placement", "pool") + tuple(f"turn {t}" for t in range(num_turns)),
        tuple(
            (_tokens(r.context), r.placement, pool)
            + tuple(_s(v) for v in r.turn_ttft[pool])
            + ("-",) * (num_turns - len(r.turn_ttft[pool]))
            for r in sessions
            for pool in ("off", "on")
        ),
    )


_VERDICT_TEXT = {NEAR_TIE: "near tie (allowed)", MISMATCH: "MISMATCH", UNKNOWN: "gap unknown"}


def divergence_table(parted: list[Record]) -> Table:
    """Every compared output that parted from its reference: where, at what gap, which tokens."""
    rows = []
    for r in parted:
        check = r.check()
        if r.experiment == "sessions":
            request = f"session {r.session} turn {r.turn}"
        else:
            request = f"{r.role} #{r.position}"
        gap = "unknown" if check.gap is None else f"{check.gap:.3g}"
        rows.append(
            (
                r.experiment,
                _tokens(r.context_tokens),
                r.condition,
                request,
                r.compared_with or "-",
                _id(check.step),
                gap,
                _VERDICT_TEXT[check.verdict],
                _id(check.reference_token),
                _id(check.output_token),
            )
        )
    return Table(
        "Outputs that part from their reference",
        (
            "experiment",
            "context",
            "condition",
            "request",
            "compared with",
            "step",
            "top-2 gap",
            "verdict",
            "reference token",
            "output token",
        ),
        tuple(rows),
        "The rule (docs/validate.md): with reuse, token ids equal a recompute's; "
        "on bf16 up to the first step whose top-2 logprob gap "
        "(the reference's top-1 minus top-2 logprob) is below 1e-3. Step: the first differing token (from 0). "
        "Near tie: parted at such a step (allowed). MISMATCH: parted at a larger gap, or one output is longer: "
        "reuse changed the output. Gap unknown: no logprobs for that step (records written before the bench "
        "asked for them, or a server that returned none).",
    )


def _id(value: int | None) -> str:
    return "-" if value is None else str(value)


def study_table(blocks, sessions) -> Table:
    return Table(
        "Beside the study's published figures (the engineering study kvshare reproduces, docs/bench.md)",
        ("figure", "study", "measured here"),
        tuple(_beside_study_rows(blocks, sessions) + _measured_rows(blocks, sessions)),
        "The study: two single-GPU replicas of a 27B model (the Qwen3.5 / 3.6 family: a hybrid of Gated DeltaNet "
        "and gated full attention) sharing a 256 GiB host-memory KV pool. Figures here come from whatever model "
        "and machine these records were measured on (see the runs below).",
    )


def _beside_study_rows(blocks, sessions) -> list[tuple[str, str, str]]:
    """The study's figures, each beside the measurement nearest its context."""
    rows = []
    measured_blocks = {r.context: r for r in blocks}
    for context, (off, on) in STUDY_BLOCKS.items():
        mine = measured_blocks.get(nearest(context, {c: None for c in measured_blocks}) or -1)
        study = f"{off:.3f} s -> {on:.3f} s ({off / on:.0f}x; {STUDY_BLOCKS_REQUESTS} requests)"
        if mine is not None and mine.off and mine.on:
            here = (
                f"{mine.off.median:.3f} s -> {mine.on.median:.3f} s ({_x(mine.speedup)}; "
                f"{mine.off.n + mine.on.n} requests, at {_tokens(mine.context)})"
            )
        else:
            here = "not measured"
        rows.append((f"cross-replica TTFT median OFF -> ON at {_tokens(context)}", study, here))
    for context, gain in STUDY_SESSIONS.items():
        alt = [r for r in sessions if r.placement == "alternate" and nearest(context, {r.context: None})]
        here = ", ".join(f"{_pct(r.improvement)} at {_tokens(r.context)}" for r in alt) or "not measured"
        rows.append(
            (f"six-turn sessions, alternating placement, {_tokens(context)} initial", f"~{gain:.0%} faster", here)
        )
    return rows


def _measured_rows(blocks, sessions) -> list[tuple[str, str, str]]:
    """The shape of the result at whatever contexts were measured (a demo on a small model, say)."""
    rows = []
    rows.append(
        (
            "cross-replica TTFT median OFF -> ON, every context measured here",
            "-",
            "; ".join(
                f"{_s(r.off.median)} s -> {_s(r.on.median)} s ({_x(r.speedup)}) at {_tokens(r.context)}"
                for r in blocks
                if r.off and r.on
            )
            or "not measured",
        )
    )
    rows.append(
        (
            "sessions, alternating placement, every initial context measured here",
            "-",
            ", ".join(
                f"{_pct(r.improvement)} at {_tokens(r.context)} ({max(len(t) for t in r.turn_ttft.values())} turns)"
                for r in sessions
                if r.placement == "alternate"
            )
            or "not measured",
        )
    )
    sticky = [r for r in sessions if r.placement == "sticky"]
    rows.append(
        (
            "sessions, fixed (sticky) placement",
            "gained little",
            ", ".join(f"{_pct(r.improvement)} at {_tokens(r.context)}" for r in sticky) or "not measured",
        )
    )
    return rows


def summary_lines(records: list[Record]) -> list[str]:
    """A few lines with the headline figures (the end of a long log)."""
    lines = []
    for r in ttft_rows(records):
        m = r.medians
        client = "" if r.client == "token_ids" else f" {r.client} (adds {_overheads(r.text_overheads)})"
        lines.append(
            f"ttft     {_tokens(r.context):>6}{client}: cold {_s(m['cold'])} s, local {_s(m['local'])} s, "
            f"cross {_s(m['cross'])} s ({_x(r.cross_speedup)}), outputs {r.outputs}, failed {r.num_failed}"
        )
    for r in blocks_rows(records):
        off = f"{_s(r.off.median)} s {format_ci(r.off.ci)}" if r.off else "-"
        on = f"{_s(r.on.median)} s {format_ci(r.on.ci)}" if r.on else "-"
        lines.append(
            f"blocks   {_tokens(r.context):>6}: OFF {off} -> ON {on} ({_x(r.speedup)}; n {r.off.n if r.off else 0}"
            f"/{r.on.n if r.on else 0}; paired ON/OFF {_s(r.ratio.median if r.ratio else None, 4)}; "
            f"min ON pool tokens {r.min_on_pool_tokens if r.min_on_pool_tokens is not None else '-'} of "
            f"{r.context}), outputs {r.outputs}, failed {r.num_failed}"
        )
    for r in sessions_rows(records):
        lines.append(
            f"sessions {_tokens(r.context):>6} {r.placement:>9}: OFF {_s(r.session_s['off'], 2)} s -> ON "
            f"{_s(r.session_s['on'], 2)} s ({_pct(r.improvement)} faster; sessions {r.num_sessions['off']}/"
            f"{r.num_sessions['on']}), outputs {r.outputs}, failed {r.num_failed}"
        )
    return lines


def markdown(tables_: list[Table], runs: list[dict], plots: list[str]) -> str:
    lines = ["# kvshare bench report", ""]
    for t in tables_:
        lines += [f"## {t.title}", "", "| " + " | ".join(t.headers) + " |", "|" + "---|" * len(t.headers)]
        lines += ["| " + " | ".join(row) + " |" for row in t.rows]
        if t.note:
            lines += ["", t.note]
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{os.path.splitext(p)[0]}]({p})" for p in plots] + [""]
    if runs:
        lines += ["## Runs", ""]
        for run in runs:
            lines.append(
                f"- `{run.get('run_id')}` {run.get('started', '')}: {run.get('experiment')} on "
                f"{json.dumps(run.get('endpoints'))}, model {run.get('model')}; {run.get('stop_reason', '')}"
            )
        lines.append("")
    return "\n".join(lines)


def write_report(results: ResultsDir) -> tuple[str, list[Table]]:
    """Rewrite records.csv, the plots and report.md from the folder's records; (report path, tables)."""
    from kvshare.bench.plots import write_plots

    records = results.load()
    results.write_csv(records)
    plots = write_plots(records, results.path)
    runs = []
    if os.path.exists(results.file("runs.jsonl")):
        with open(results.file("runs.jsonl")) as f:
            runs = [json.loads(line) for line in f if line.strip()]
    tables_ = tables(records)
    path = results.file("report.md")
    with open(path, "w") as f:
        f.write(markdown(tables_, runs, plots))
    return path, tables_


def print_tables(tables_: list[Table], console=None) -> None:
    from rich.console import Console
    from rich.table import Table as RichTable

    console = console or Console()
    if not console.is_terminal:
        console = Console(file=console.file, width=max(console.width, 160))  # logs, pipes: wide, not truncated
    for t in tables_:
        table = RichTable(title=t.title, caption=t.note or None)  # the note says what the figures mean
        for h in t.headers:
            table.add_column(h)
        for row in t.rows:
            table.add_row(*row)
        console.print(table)
