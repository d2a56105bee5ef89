"""Statistics of measurements: medians, percentiles, bootstrap intervals, pairing by position, ratios.

The experiments' (kvshare.bench), the load runs' (kvshare.reliability) and the benchmarks' rows
(kvshare.integrations.vllm.gpu_rows) take theirs from here.

Pure functions of their inputs (a fixed seed makes every interval reproducible).
The blocked design pairs the k-th OFF block with the k-th ON block, position by
position::

    blocks     OFF#0    ON#0    ON#1    OFF#1
    pairs      (OFF#0[i], ON#0[i])   and   (OFF#1[i], ON#1[i])   for i < per_block

so slow drift of the machine over the run (thermal, other load) affects both
members of a pair alike, and the design is balanced in time (OFF, ON, ON, OFF).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 20261129
MIN_N_FOR_CI = 6  # below this many values an interval is not reported (it would be meaningless)


def median(values: Sequence[float]) -> float:
    """The median; the mean of the two middle values for an even count."""
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[mid])
    return (ordered[mid - 1] + ordered[mid]) / 2.0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must lie in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile (q in [0, 1]) of a Prometheus histogram, as PromQL's ``histogram_quantile`` reads it:
    ``buckets`` are (upper bound, cumulative count) in ascending bounds, the last +Inf; linear within the bucket
    the rank falls in (from 0 for the first), the highest finite bound for a rank in +Inf's; None: no samples."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = bound, count
    return lower


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high


def bootstrap_ci(
    values: Sequence[float],
    statistic: Callable[[Sequence[float]], float] = median,
    confidence: float = 0.95,
    num_resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> Interval:
    """Percentile bootstrap interval of ``statistic`` over ``values`` (resampled with replacement)."""
    import numpy as np

    if not values:
        raise ValueError("bootstrap of no values")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(data), size=(num_resamples, len(data)))  # [R, n]
    if statistic is median:
        stats = np.median(data[picks], axis=1)  # same definition as median(), vectorised
    else:
        stats = np.array([statistic(list(data[p])) for p in picks])
    tail = (1.0 - confidence) / 2.0 * 100.0
    return Interval(float(np.percentile(stats, tail)), float(np.percentile(stats, 100.0 - tail)))


def pair_blocks(blocks: Sequence[tuple[str, Sequence[float]]]) -> list[tuple[float, float]]:
    """(off, on) pairs: the k-th OFF block with the k-th ON block, by position within the blocks.

    ``blocks`` is the design in run order, e.g. [("off", [...]), ("on", [...]), ("on", [...]), ("off", [...])].
    Positions missing from either block of a pair (an interrupted run, a failed request) are skipped.
    """
    off = [values for condition, values in blocks if condition == "off"]
    on = [values for condition, values in blocks if condition == "on"]
    unknown = {condition for condition, _ in blocks} - {"off", "on"}
    if unknown:
        raise ValueError(f"block conditions must be 'off' or 'on', got {sorted(unknown)}")
    pairs = []
    for off_block, on_block in zip(off, on):
        pairs.extend(zip(off_block, on_block))
    return pairs


def paired_ratios(pairs: Sequence[tuple[float, float]]) -> list[float]:
    """on / off for each (off, on) pair."""
    if any(off <= 0 for off, _ in pairs):
        raise ValueError("an OFF time is not positive: ratios would be undefined")
    return [on / off for off, on in pairs]


def improvement(off: float, on: float) -> float:
    """Fraction of the OFF time saved by ON (0.35 = 35% faster); negative when ON is slower."""
    if off <= 0:
        raise ValueError("the OFF time must be positive")
    return 1.0 - on / off


@dataclass(frozen=True)
class Summary:
    """Median of a sample with its interval (None when the sample is too small for one)."""

    n: int
    median: float
    ci: Interval | None


def summarize(values: Sequence[float], min_n_for_ci: int = MIN_N_FOR_CI, seed: int = DEFAULT_SEED) -> Summary:
    ci = bootstrap_ci(values, seed=seed) if len(values) >= min_n_for_ci else None
    return Summary(len(values), median(values), ci)
