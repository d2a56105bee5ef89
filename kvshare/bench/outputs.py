"""Did reuse change the output? One compared pair -> a verdict; many -> the tables' "outputs" cell. Pure.

The rule is DESIGN.md's ("What correct means"), as kvshare.validate.compare states it:
token ids at temperature 0 are identical, except that on bf16 they may part at a step
where the reference's two most likely tokens nearly tie::

    reference  t0 t1 t2 r3 ...    step 3: the first difference; gap = the reference's
    output     t0 t1 t2 o3 ...    top-1 minus top-2 logprob at step 3

    equal      the same ids, the same length
    near-tie   parted at a step whose gap < 1e-3 (allowed: KV recomputed another way is not
               bitwise equal, and at a near tie that noise flips the argmax)
    mismatch   parted at a step whose gap >= 1e-3, or one output is longer: reuse changed the output
    unknown    parted, but the reference's logprobs at that step are unknown (records written
               before the bench asked for them, a server that returned none): not shown allowed
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from kvshare.validate.compare import DEFAULT_GAP_THRESHOLD, compare_tokens

EQUAL, NEAR_TIE, MISMATCH, UNKNOWN = "equal", "near-tie", "mismatch", "unknown"
VERDICTS = (EQUAL, NEAR_TIE, MISMATCH, UNKNOWN)
MAX_LISTED = 3  # divergences described in a table cell; the divergence table lists all


@dataclass(frozen=True)
class OutputCheck:
    """One output against its reference."""

    verdict: str  # one of VERDICTS
    step: int | None = None  # first step whose ids differ (or where the shorter output ends); None: equal
    gap: float | None = None  # the reference's top-1 minus top-2 logprob at ``step``; None: equal or unknown
    reference_token: int | None = None  # the reference's id at ``step`` (None past its end)
    output_token: int | None = None  # the output's id at ``step`` (None past its end)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"an output verdict is one of {', '.join(VERDICTS)}; got {self.verdict!r}")

    @property
    def is_equal(self) -> bool:
        return self.verdict == EQUAL

    def describe(self) -> str:
        """e.g. "step 5, gap 0.031" (what a table cell shows of a divergence)."""
        if self.is_equal:
            return "equal"
        step = f"step {'unknown' if self.step is None else self.step}"
        if self.gap is not None:
            return f"{step}, gap {format_gap(self.gap)}"
        return step + (", lengths differ" if self.verdict == MISMATCH else "")


def format_gap(gap: float | None) -> str:
    return "unknown" if gap is None else f"{gap:.2g}"


def check_outputs(reference: Sequence[int] | None, output: Sequence[int] | None,
                  reference_top_logprobs: Sequence[Sequence[float]] | None = None,
                  threshold: float = DEFAULT_GAP_THRESHOLD) -> OutputCheck | None:
    """``output`` against ``reference`` (token ids; ``reference_top_logprobs[i]``: the reference's top
    logprobs at step i); None when either output is unknown (a failed request)."""
    if reference is None or output is None:
        return None
    cmp = compare_tokens(reference, output, reference_top_logprobs, threshold)
    step = cmp.divergence_step
    if step is None:
        if len(reference) == len(output):
            return OutputCheck(EQUAL)
        step = cmp.num_compared  # one output stops early: no near tie explains that
        return OutputCheck(MISMATCH, step, None, _at(reference, step), _at(output, step))
    if cmp.gap is None:
        verdict = UNKNOWN
    else:
        verdict = NEAR_TIE if cmp.is_tolerated else MISMATCH
    return OutputCheck(verdict, step, cmp.gap, reference[step], output[step])


def _at(ids: Sequence[int], step: int) -> int | None:
    return ids[step] if step < len(ids) else None


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
        """Every output equal, or parted at a near tie (what DESIGN allows)."""
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
