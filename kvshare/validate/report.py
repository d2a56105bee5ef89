"""Results of ``kvshare validate``: one verdict per level, with rows and figures; a rich table and JSON.

A level *passes* when everything it ran is right, *fails* when anything is wrong
(or it could not run where it should have), and is *skipped* when the machine
lacks what it needs (no GPU, no replicas): skipped is never counted as passed.
Rows are the level's parts (a transfer path, a layout, a phase, a prompt); a row
of kind "control" is a deliberately broken variant whose verdict is "caught".
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, SKIP, CAUGHT = "pass", "fail", "skip", "caught"
LEVELS = ("bytes", "helpers", "full-pool", "service", "isolation")  # the ladder, in the order the report shows it
DEFAULT_LEVELS = LEVELS[:4]  # isolation starts a cluster of its own: asked for by name


@dataclass
class Row:
    name: str
    status: str  # pass | fail | skip | caught
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass
class LevelResult:
    level: str
    status: str  # pass | fail | skip
    summary: str = ""  # one line with the figures that matter
    rows: list[Row] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""  # why the level could not run to the end (an exception's message)

    @property
    def failed(self) -> bool:
        return self.status == FAIL


def verdict_of(rows: list[Row]) -> str:
    """fail if any row failed; skip if every row was skipped (or there are none); else pass."""
    if any(r.status == FAIL for r in rows):
        return FAIL
    if all(r.status == SKIP for r in rows):
        return SKIP
    return PASS


@dataclass
class ValidateReport:
    levels: list[LevelResult]
    settings: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return not any(level.failed for level in self.levels)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def ordered(self) -> list[LevelResult]:
        rank = {name: i for i, name in enumerate(LEVELS)}
        return sorted(self.levels, key=lambda r: rank.get(r.level, len(rank)))

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "started_at": self.started_at,
            "host": platform.node(),
            "settings": self.settings,
            "levels": [asdict(level) for level in self.ordered()],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)
            f.write("\n")

    def render(self, console, details: bool = True) -> None:
        """Per-level detail tables (optional), then the pass/fail table."""
        from rich.markup import escape
        from rich.table import Table

        if details:
            for level in self.ordered():
                if not level.rows:
                    continue
                table = Table(title=f"{level.level}: {_styled(level.status)}", title_justify="left", show_lines=False)
                table.add_column("part")
                table.add_column("verdict")
                table.add_column("figures / detail", overflow="fold")
                for row in level.rows:
                    table.add_row(escape(row.name), _styled(row.status), escape(_row_text(row)))
                console.print(table)
        summary = Table(title="kvshare validate", title_justify="left")
        summary.add_column("level")
        summary.add_column("verdict")
        summary.add_column("time", justify="right")
        summary.add_column("figures", overflow="fold")
        for level in self.ordered():
            text = escape(level.summary) + (f" [red]{escape(level.error)}[/red]" if level.error else "")
            summary.add_row(level.level, _styled(level.status), f"{level.seconds:.1f} s", text)
        console.print(summary)
        console.print(
            "[bold green]all levels passed[/bold green]"
            if self.ok and any(r.status == PASS for r in self.levels)
            else "[bold red]FAILED[/bold red]"
            if not self.ok
            else "[yellow]nothing passed (all skipped)[/yellow]"
        )


def _row_text(row: Row) -> str:
    figures = ", ".join(f"{k} {_fmt(v)}" for k, v in row.figures.items())
    return "; ".join(p for p in (figures, row.detail) if p)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _styled(status: str) -> str:
    color = {PASS: "green", CAUGHT: "green", FAIL: "bold red", SKIP: "yellow"}.get(status, "white")
    return f"[{color}]{status}[/{color}]"
