"""The output-equality rule of DESIGN.md ("What correct means"), as a pure function.

Reuse must not change what the model generates. At temperature 0 the token ids of a
run with reused KV are compared with those of a run that recomputed everything:

- float32 (CPU): identical;
- bf16 (GPU): identical up to the first step whose top-2 logprob gap (in the
  recomputing run) is below a threshold (DESIGN: 1e-3). KV recomputed with a
  different chunking is not bitwise equal, and at a near tie that noise can flip
  the argmax; past such a step the two continuations need not agree.

    reference  t0 t1 t2 t3 t4 ...     step 3: first difference; gap = top1 - top2 of the
    candidate  t0 t1 t2 u3 u4 ...     reference's logprobs at step 3; tolerated iff gap < threshold

No imports from the rest of kvshare: the service level and the replica's audit share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

DEFAULT_GAP_THRESHOLD = 1e-3


@dataclass(frozen=True)
class Comparison:
    """How a candidate continuation compares with the reference (the recomputed one)."""

    num_compared: int  # steps compared (the shorter of the two)
    divergence_step: int | None  # first step whose token ids differ; None: identical
    gap: float | None  # reference top-1 minus top-2 logprob at that step; None: identical or unknown
    threshold: float

    @property
    def is_identical(self) -> bool:
        return self.divergence_step is None

    @property
    def is_tolerated(self) -> bool:
        """Diverged, but at a near tie (gap below the threshold): allowed by the rule."""
        return self.divergence_step is not None and self.gap is not None and self.gap < self.threshold

    @property
    def passed(self) -> bool:
        return self.is_identical or self.is_tolerated

    def describe(self) -> str:
        if self.is_identical:
            return f"identical ({self.num_compared} tokens)"
        gap = "unknown" if self.gap is None else f"{self.gap:.3g}"
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
) -> Comparison:
    """Compare two greedy continuations step by step (``reference_top_logprobs[i]``: the reference's top
    logprobs at step i, at least two of them, for the gap at a divergence)."""
    if threshold < 0:
        raise ValueError(f"the gap threshold must be >= 0, got {threshold}")
    n = min(len(reference), len(candidate))
    for step in range(n):
        if int(reference[step]) != int(candidate[step]):
            known = reference_top_logprobs is not None and step < len(reference_top_logprobs)
            gap = top2_gap(reference_top_logprobs[step]) if known else None
            return Comparison(n, step, gap, threshold)
    return Comparison(n, None, None, threshold)
