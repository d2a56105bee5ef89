"""The tables' "outputs" cell: the verdicts of a group of compared outputs, tallied. Pure.

The verdict of one output (equal, near-tie, mismatch, unknown) and the rule behind it are
kvshare.outputs's; this module only counts them and lists the divergences a cell shows, e.g.
"equal 3/4; near-tie 0; mismatch 1 (step 5, gap 0.031)".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvshare.outputs import EQUAL, MISMATCH, NEAR_TIE, UNKNOWN, OutputCheck

MAX_LISTED = 3  # divergences described in a table cell; the divergence table lists all


@dataclass(frozen=True)
class OutputTally:
    """The verdicts of a group of compared outputs (a table row)."""

    checks: tuple[OutputCheck, ...]

    def count(self, verdict: str) -> int:
        return sum(c.verdict == verdict for c in self.checks)

    @property
    def num_equal(self) -> int:
        return self.count(EQUAL)

    @property
    def num_compared(self) -> int:
        return len(self.checks)

    @property
    def is_clean(self) -> bool:
        """Every output equal, or parted at a near tie (what the rule allows)."""
        return all(c.verdict in (EQUAL, NEAR_TIE) for c in self.checks)

    def __str__(self) -> str:
        """e.g. "equal 3/4; near-tie 0; mismatch 1 (step 5, gap 0.031)"; "-" when nothing was compared."""
        if not self.checks:
            return "-"
        parts = [f"equal {self.num_equal}/{self.num_compared}"]
        for verdict in (NEAR_TIE, MISMATCH, UNKNOWN):
            if verdict == UNKNOWN and not self.count(UNKNOWN):
                continue  # only older records (written without logprobs) have these
            mine = [c for c in self.checks if c.verdict == verdict]
            label = "gap unknown" if verdict == UNKNOWN else verdict
            parts.append(f"{label} {len(mine)}" + _listed(mine))
        return "; ".join(parts)


def _listed(checks: list[OutputCheck]) -> str:
    if not checks:
        return ""
    shown = "; ".join(c.describe() for c in checks[:MAX_LISTED])
    return f" ({shown}{'; ...' if len(checks) > MAX_LISTED else ''})"


def tally(checks: Iterable[OutputCheck | None]) -> OutputTally:
    return OutputTally(tuple(c for c in checks if c is not None))
