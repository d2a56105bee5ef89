"""The output-equality rule (DESIGN.md, "What correct means") as the service level and the audit apply it."""

from __future__ import annotations

import pytest

from kvshare.validate.compare import compare_tokens, top2_gap


def test_identical_continuations_pass():
    c = compare_tokens([5, 6, 7], [5, 6, 7], None)
    assert c.is_identical and c.passed and c.num_compared == 3 and "identical" in c.describe()


def test_divergence_at_a_near_tie_is_tolerated_and_reported():
    top = [[-0.1, -3.0], [-0.6930, -0.6935], [-0.2, -2.0]]  # step 1: gap 5e-4
    c = compare_tokens([5, 6, 7], [5, 9, 1], top, threshold=1e-3)
    assert c.divergence_step == 1 and c.gap == pytest.approx(5e-4) and c.is_tolerated and c.passed
    assert "step 1" in c.describe() and "tolerated" in c.describe()


def test_divergence_with_a_clear_winner_is_a_mismatch():
    top = [[-0.1, -3.0], [-0.05, -2.5]]
    c = compare_tokens([5, 6], [5, 8], top, threshold=1e-3)
    assert c.divergence_step == 1 and c.gap == pytest.approx(2.45) and not c.passed
    assert "mismatch" in c.describe()
    assert compare_tokens([5, 6], [5, 8], top, threshold=3.0).passed  # the threshold is the operator's


def test_an_unknown_gap_is_a_mismatch_and_a_zero_threshold_demands_exactness():
    assert not compare_tokens([1, 2], [1, 3], None).passed  # no logprobs: cannot call it a tie
    assert not compare_tokens([1, 2], [1, 3], [[-1.0], [-0.5]]).passed  # one logprob: no gap
    assert not compare_tokens([1, 2], [1, 3], [[0, -1], [-0.5, -0.5]], threshold=0.0).passed  # exact tie, threshold 0


def test_top2_gap_takes_the_two_largest_in_any_order():
    assert top2_gap([-3.0, -0.5, -1.0]) == pytest.approx(0.5)
    assert top2_gap([]) is None and top2_gap(None) is None
    with pytest.raises(ValueError):
        compare_tokens([1], [1], None, threshold=-1)
