"""Did reuse change the output? The rule of docs/validate.md ("What correct means"), as pure functions.

Reuse must not change what the model generates. At temperature 0 the token ids of a
run with reused KV are compared with those of a run that recomputed everything:

- float32 (CPU): identical;
- bf16 (GPU): identical up to the first step whose top-2 logprob gap (in the
  recomputing run) is below a threshold (1e-3 by default). KV recomputed with a
  different chunking is not bitwise equal, and at a near tie that noise can flip
  the argmax; past such a step the two continuations need not agree.

    reference  t0 t1 t2 t3 t4 ...     step 3: first difference; gap = top1 - top2 of the
    candidate  t0 t1 t2 u3 u4 ...     reference's logprobs at step 3; tolerated iff gap < threshold

- exact (the built-in engine's deterministic mode, whose prefill is chunk-invariant): reuse gives
  the same bits as recomputing, so nothing is tolerated. The first step whose ids differ, or whose
  logprobs differ where both runs report them, is a failure, reported with both tokens.

``compare_tokens`` states the rule (a ``Comparison``); ``check_outputs`` turns it into one
output's verdict (an ``OutputCheck``)::

    equal      the same ids, the same length
    near-tie   parted at a step whose gap < the threshold (allowed)
    mismatch   parted at a step whose gap >= the threshold, or one output is longer: reuse changed the output
    unknown    parted, but the reference's logprobs at that step are unknown (records written
               before the bench asked for them, a server that returned none): not shown allowed

No imports from the rest of kvshare: the replica's audit (kvshare.serve.audit), the
service level (kvshare.validate) and the bench's tables (kvshare.bench) share it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_GAP_THRESHOLD = 1e-3


@dataclass(frozen=True)
class Comparison:
    """How a candidate continuation compares with the reference (the recomputed one)."""

    num_compared: int  # steps compared (the shorter of the two)
    divergence_step: int | None  # first step whose token ids differ; None: identical
    gap: float | None  # reference top-1 minus top-2 logprob at that step; None: identical or unknown
    threshold: float
    is_exact: bool = False  # the exact rule (deterministic mode): any difference fails, the gap is only reported
    reference_token: int | None = None  # the two ids at divergence_step
    candidate_token: int | None = None
    is_logprob_divergence: bool = False  # exact rule: the ids agree at divergence_step, their logprobs do not
    # exact rule: the two runs' logprobs at divergence_step (None: not given); and the steps whose logprobs
    # both runs gave (so were compared): fewer than num_compared means the rule saw only ids there
    reference_logprobs: tuple[float, ...] | None = None
    candidate_logprobs: tuple[float, ...] | None = None
    num_logprob_steps: int = 0

    @property
    def is_identical(self) -> bool:
        return self.divergence_step is None

    @property
    def is_tolerated(self) -> bool:
        """Diverged, but at a near tie (gap below the threshold): allowed by the gap rule, never by the exact one."""
        if self.is_exact:
            return False
        return self.divergence_step is not None and self.gap is not None and self.gap < self.threshold

    @property
    def passed(self) -> bool:
        return self.is_identical or self.is_tolerated

    @property
    def is_logprobs_compared(self) -> bool:
        """Every compared step had logprobs from both runs (what the exact rule needs to say "bitwise")."""
        return self.num_logprob_steps >= self.num_compared

    def describe(self) -> str:
        if self.is_identical:
            if not self.is_exact:
                return f"identical ({self.num_compared} tokens)"
            what = (
                "ids and logprobs"
                if self.is_logprobs_compared
                else f"ids; logprobs at {self.num_logprob_steps} of them"
            )
            return f"identical ({self.num_compared} tokens, {what})"
        gap = "unknown" if self.gap is None else f"{self.gap:.3g}"
        if self.is_exact:
            what = (
                f"logprobs differ (both token {self.reference_token})"
                if self.is_logprob_divergence
                else f"token {self.reference_token} (reference) vs {self.candidate_token}"
            )
            if self.reference_logprobs is not None or self.candidate_logprobs is not None:
                what += f", logprobs {_values(self.reference_logprobs)} vs {_values(self.candidate_logprobs)}"
            return (
                f"differs at step {self.divergence_step} of {self.num_compared}: {what}, top-2 gap {gap} "
                "(exact mode: any difference is a mismatch)"
            )
        verdict = "near tie, tolerated" if self.is_tolerated else f"gap >= {self.threshold:g}: mismatch"
        return f"diverged at step {self.divergence_step} of {self.num_compared}, top-2 gap {gap} ({verdict})"


def top2_gap(logprobs: Iterable[float] | None) -> float | None:
    """top-1 minus top-2 of a step's top logprobs (any order); None when fewer than two are known."""
    values = sorted((float(v) for v in (logprobs or ()) if v is not None and not math.isnan(float(v))), reverse=True)
    if len(values) < 2:
        return None
    return values[0] - values[1]


def compare_tokens(
    reference: Sequence[int],
    candidate: Sequence[int],
    reference_top_logprobs: Sequence[Iterable[float] | None] | None = None,
    threshold: float = DEFAULT_GAP_THRESHOLD,
    candidate_top_logprobs: Sequence[Iterable[float] | None] | None = None,
    is_exact: bool = False,
) -> Comparison:
    """Compare two greedy continuations step by step (``reference_top_logprobs[i]``: the reference's top
    logprobs at step i, at least two of them, for the gap at a divergence). ``is_exact``: the exact rule,
    which also compares the two runs' logprobs at every step where both are given."""
    if threshold < 0:
        raise ValueError(f"the gap threshold must be >= 0, got {threshold}")
    n = min(len(reference), len(candidate))
    num_logprob_steps = 0
    for step in range(n):
        ref, got = int(reference[step]), int(candidate[step])
        both_known = _known(reference_top_logprobs, step) and _known(candidate_top_logprobs, step)
        is_logprob_divergence = (
            ref == got and is_exact and _logprobs_differ(reference_top_logprobs, candidate_top_logprobs, step)
        )
        if ref != got or is_logprob_divergence:
            gap = top2_gap(reference_top_logprobs[step]) if _known(reference_top_logprobs, step) else None
            return Comparison(
                n,
                step,
                gap,
                threshold,
                is_exact,
                ref,
                got,
                is_logprob_divergence,
                _at_step(reference_top_logprobs, step),
                _at_step(candidate_top_logprobs, step),
                num_logprob_steps + both_known,
            )
        num_logprob_steps += both_known
    return Comparison(n, None, None, threshold, is_exact, num_logprob_steps=num_logprob_steps)


def _at_step(logprobs: Sequence | None, step: int) -> tuple[float, ...] | None:
    return tuple(float(v) for v in logprobs[step]) if _known(logprobs, step) else None


def _values(logprobs: tuple[float, ...] | None) -> str:
    """Logprobs as the report shows them: every digit a float32/bf16 difference may sit in."""
    return "unknown" if logprobs is None else "[" + ", ".join(f"{v:.9g}" for v in logprobs) + "]"


def _known(logprobs: Sequence | None, step: int) -> bool:
    return logprobs is not None and step < len(logprobs) and logprobs[step] is not None


def _logprobs_differ(reference: Sequence | None, candidate: Sequence | None, step: int) -> bool:
    """Both runs report logprobs at ``step`` and they are not the same values (NaN equals NaN here)."""
    if not (_known(reference, step) and _known(candidate, step)):
        return False
    a, b = [float(v) for v in reference[step]], [float(v) for v in candidate[step]]
    return len(a) != len(b) or any(x != y and not (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


EQUAL, NEAR_TIE, MISMATCH, UNKNOWN = "equal", "near-tie", "mismatch", "unknown"
VERDICTS = (EQUAL, NEAR_TIE, MISMATCH, UNKNOWN)


@dataclass(frozen=True)
class OutputCheck:
    """One output against its reference."""

    verdict: str  # one of VERDICTS
    step: int | None = None  # first step whose ids differ (or where the shorter output ends); None: equal
    gap: float | None = None  # the reference's top-1 minus top-2 logprob at ``step``; None: equal or unknown
    reference_token: int | None = None  # the reference's id at ``step`` (None past its end)
    output_token: int | None = None  # the output's id at ``step`` (None past its end)
    is_exact: bool = False  # judged by the exact rule (deterministic mode): never a near tie

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
        if self.is_exact and self.step is not None:
            if self.reference_token is not None and self.reference_token == self.output_token:
                return f"{step}, logprobs differ (exact)"
            return f"{step}, tokens {self.reference_token} vs {self.output_token} (exact)"
        if self.gap is not None:
            return f"{step}, gap {format_gap(self.gap)}"
        return step + (", lengths differ" if self.verdict == MISMATCH else "")


def format_gap(gap: float | None) -> str:
    return "unknown" if gap is None else f"{gap:.2g}"


def check_outputs(
    reference: Sequence[int] | None,
    output: Sequence[int] | None,
    reference_top_logprobs: Sequence[Sequence[float]] | None = None,
    threshold: float = DEFAULT_GAP_THRESHOLD,
    output_top_logprobs: Sequence[Sequence[float]] | None = None,
    is_exact: bool = False,
) -> OutputCheck | None:
    """``output`` against ``reference`` (token ids; ``reference_top_logprobs[i]``: the reference's top
    logprobs at step i); None when either output is unknown (a failed request). ``is_exact``: the exact
    rule (equal or mismatch, logprobs compared too)."""
    if reference is None or output is None:
        return None
    cmp = compare_tokens(reference, output, reference_top_logprobs, threshold, output_top_logprobs, is_exact)
    step = cmp.divergence_step
    if step is None:
        if len(reference) == len(output):
            return OutputCheck(EQUAL, is_exact=is_exact)
        step = cmp.num_compared  # one output stops early: no near tie explains that
        return OutputCheck(MISMATCH, step, None, _at(reference, step), _at(output, step), is_exact)
    if is_exact:
        verdict = MISMATCH
    elif cmp.gap is None:
        verdict = UNKNOWN
    else:
        verdict = NEAR_TIE if cmp.is_tolerated else MISMATCH
    return OutputCheck(verdict, step, cmp.gap, reference[step], output[step], is_exact)


def _at(ids: Sequence[int], step: int) -> int | None:
    return ids[step] if step < len(ids) else None
