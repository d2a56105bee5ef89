"""Statistics of the experiments, against answers worked out by hand."""

from __future__ import annotations

import pytest

from kvshare.stats import (
    Interval,
    bootstrap_ci,
    histogram_quantile,
    improvement,
    median,
    pair_blocks,
    paired_ratios,
    percentile,
    summarize,
)


def test_median_odd_even_and_unsorted():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([7.0]) == 7.0
    with pytest.raises(ValueError):
        median([])


def test_percentile_interpolates_like_numpy():
    import numpy as np

    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 2.5, 25, 50, 90, 97.5, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 25) == 2.0


def test_bootstrap_of_a_constant_sample_is_that_constant():
    assert bootstrap_ci([0.5] * 10) == Interval(0.5, 0.5)


def test_bootstrap_is_reproducible_with_its_seed_and_changes_with_another():
    values = [1.0, 2.0, 2.5, 3.0, 4.0, 8.0, 9.5, 10.0]
    a, b = bootstrap_ci(values, seed=1), bootstrap_ci(values, seed=1)
    assert a == b
    assert bootstrap_ci(values, seed=2) != a


def test_bootstrap_interval_brackets_the_median_and_lies_in_the_data_range():
    values = [float(v) for v in range(1, 21)]  # median 10.5
    ci = bootstrap_ci(values)
    assert 10.5 in ci
    assert 1.0 <= ci.low < 10.5 < ci.high <= 20.0
    # a wider confidence gives a wider (or equal) interval
    wide = bootstrap_ci(values, confidence=0.99)
    assert wide.low <= ci.low and wide.high >= ci.high


def test_bootstrap_of_two_values_spans_them():
    # resampling two values: medians are 1, 1.5 or 2, each resample pair being (a,a), (a,b), (b,b)
    ci = bootstrap_ci([1.0, 2.0], num_resamples=4000)
    assert ci == Interval(1.0, 2.0)


def test_bootstrap_with_another_statistic():
    ci = bootstrap_ci([1.0, 1.0, 1.0, 5.0], statistic=max, num_resamples=500)
    assert ci.low == 1.0 and ci.high == 5.0


def test_pairing_is_kth_off_with_kth_on_by_position():
    design = [("off", [10.0, 11.0]), ("on", [1.0, 1.1]), ("on", [2.0, 2.1]), ("off", [20.0, 21.0])]
    assert pair_blocks(design) == [(10.0, 1.0), (11.0, 1.1), (20.0, 2.0), (21.0, 2.1)]
    assert paired_ratios(pair_blocks(design)) == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_pairing_skips_positions_missing_from_either_block():
    design = [("off", [10.0, 11.0, 12.0]), ("on", [1.0])]
    assert pair_blocks(design) == [(10.0, 1.0)]


def test_pairing_refuses_unknown_conditions():
    with pytest.raises(ValueError):
        pair_blocks([("off", [1.0]), ("maybe", [1.0])])


def test_ratios_refuse_a_zero_off_time():
    with pytest.raises(ValueError):
        paired_ratios([(0.0, 1.0)])


def test_improvement_of_the_study_figures():
    assert improvement(31.715, 0.605) == pytest.approx(1 - 0.605 / 31.715)
    assert improvement(100.0, 65.0) == pytest.approx(0.35)
    assert improvement(1.0, 2.0) == pytest.approx(-1.0)  # slower: negative


def test_summarize_reports_an_interval_only_for_enough_values():
    assert summarize([1.0, 2.0, 3.0]).ci is None
    s = summarize([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert s.n == 6 and s.median == 3.5 and s.ci is not None and 3.5 in s.ci


def test_a_histograms_quantile_is_read_as_promql_reads_it():
    inf = float("inf")
    # 10 samples, all in (1, 2]: the median halfway through that bucket
    assert histogram_quantile(0.5, [(1.0, 0), (2.0, 10), (inf, 10)]) == pytest.approx(1.5)
    # the first bucket interpolates from 0; 99 of 100 samples lie at or below 1.98 by the buckets
    assert histogram_quantile(0.5, [(1.0, 4), (2.0, 4), (inf, 4)]) == pytest.approx(0.5)
    assert histogram_quantile(0.99, [(1.0, 50), (2.0, 100), (inf, 100)]) == pytest.approx(1.98)
    # a rank in +Inf's bucket: the highest finite bound; no samples: no quantile
    assert histogram_quantile(0.99, [(1.0, 0), (inf, 5)]) == 1.0
    assert histogram_quantile(0.5, [(1.0, 0), (inf, 0)]) is None and histogram_quantile(0.5, []) is None
