"""The output-equality rule (docs/validate.md, "What correct means") as the audit, the service level and the bench
apply it.

Output checks with known answers: equal, a near tie (allowed), a mismatch (never passed off as equal).
"""

from __future__ import annotations

import pytest

from kvshare.outputs import EQUAL, MISMATCH, NEAR_TIE, UNKNOWN, OutputCheck, check_outputs, compare_tokens, top2_gap


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


# -- one output's verdict (check_outputs) ----------------------------------------------------------------

REFERENCE = [10, 11, 12, 13, 14]
# the reference's top-2 logprobs per step; steps 2 and 3 are close calls
TOPS = [[-0.1, -3.0], [-0.2, -2.5], [-0.6930, -0.6935], [-0.50, -0.531], [-0.3, -1.9]]


def test_equal_outputs():
    assert check_outputs(REFERENCE, list(REFERENCE), TOPS) == OutputCheck(EQUAL)
    assert check_outputs(REFERENCE, list(REFERENCE)).is_equal  # no logprobs needed to see equality


def test_parting_at_a_near_tie_is_allowed_and_says_where():
    check = check_outputs(REFERENCE, [10, 11, 99, 98, 97], TOPS)
    assert check.verdict == NEAR_TIE and check.step == 2 and check.gap == pytest.approx(5e-4)
    assert (check.reference_token, check.output_token) == (12, 99)
    assert not check.is_equal and check.describe() == "step 2, gap 0.0005"


def test_negative_control_parting_at_a_large_gap_is_a_mismatch():
    check = check_outputs(REFERENCE, [10, 11, 12, 77, 14], TOPS)
    assert check.verdict == MISMATCH and check.step == 3 and check.gap == pytest.approx(0.031)
    assert (check.reference_token, check.output_token) == (13, 77)
    assert check.describe() == "step 3, gap 0.031"
    # a first-step difference with a clear winner: never equal, never a near tie
    check = check_outputs(REFERENCE, [55, 11, 12, 13, 14], TOPS)
    assert (check.verdict, check.step, check.gap) == (MISMATCH, 0, pytest.approx(2.9))


def test_the_threshold_is_1e3_strict_and_adjustable():
    assert check_outputs([1], [2], [[-1.0, -1.0009]]).verdict == NEAR_TIE
    assert check_outputs([1], [2], [[-1.0, -1.0011]]).verdict == MISMATCH
    assert check_outputs([1], [2], [[0.0, -0.5]], threshold=0.5).verdict == MISMATCH  # a gap at the threshold
    assert check_outputs([1], [2], [[-1.0, -1.0011]], threshold=0.01).verdict == NEAR_TIE
    assert check_outputs([1], [2], [[-1.2, -1.0]]).gap == pytest.approx(0.2)  # candidates in any order


def test_no_logprobs_at_the_step_leaves_the_gap_unknown():
    assert check_outputs(REFERENCE, [10, 99, 12, 13, 14]).verdict == UNKNOWN
    check = check_outputs(REFERENCE, [10, 99, 12, 13, 14], [[-0.1, -3.0], [-0.2]])  # only one value at step 1
    assert (check.verdict, check.step, check.gap, check.output_token) == (UNKNOWN, 1, None, 99)
    assert check.describe() == "step 1"


def test_an_output_that_stops_early_is_a_mismatch():
    check = check_outputs(REFERENCE, REFERENCE[:3], TOPS)
    assert (check.verdict, check.step, check.reference_token, check.output_token) == (MISMATCH, 3, 13, None)
    assert check.describe() == "step 3, lengths differ"


def test_unknown_outputs_are_not_compared():
    assert check_outputs(None, REFERENCE) is None and check_outputs(REFERENCE, None) is None


def test_a_verdict_must_be_known():
    with pytest.raises(ValueError):
        OutputCheck("fine")


def test_the_exact_rule_tolerates_nothing_and_names_both_tokens():
    top = [[-0.1, -3.0], [-0.6930, -0.6935]]  # step 1: a near tie the gap rule allows
    assert compare_tokens([5, 6], [5, 9], top, threshold=1e-3).passed
    c = compare_tokens([5, 6], [5, 9], top, threshold=1e-3, is_exact=True)
    assert not c.passed and not c.is_tolerated and c.divergence_step == 1
    assert (c.reference_token, c.candidate_token) == (6, 9) and "token 6 (reference) vs 9" in c.describe()
    check = check_outputs([5, 6], [5, 9], top, is_exact=True)
    assert check.verdict == MISMATCH and (check.step, check.reference_token, check.output_token) == (1, 6, 9)
    assert check_outputs([5, 6], [5, 9], None, is_exact=True).verdict == MISMATCH  # no gap needed to fail
    assert "tokens 6 vs 9" in check.describe()


def test_the_exact_rule_compares_logprobs_where_both_runs_give_them():
    ref, same, moved = [[-0.1, -3.0], [-0.5, -1.0]], [[-0.1, -3.0], [-0.5, -1.0]], [[-0.1, -3.0], [-0.5, -1.0000001]]
    assert compare_tokens([5, 6], [5, 6], ref, candidate_top_logprobs=same, is_exact=True).is_identical
    c = compare_tokens([5, 6], [5, 6], ref, candidate_top_logprobs=moved, is_exact=True)
    assert c.divergence_step == 1 and c.is_logprob_divergence and not c.passed and "logprobs differ" in c.describe()
    assert compare_tokens([5, 6], [5, 6], ref, candidate_top_logprobs=moved).is_identical  # the gap rule: ids only
    assert compare_tokens([5, 6], [5, 6], ref, candidate_top_logprobs=None, is_exact=True).is_identical  # unknown
    check = check_outputs([5, 6], [5, 6], ref, output_top_logprobs=moved, is_exact=True)
    assert check.verdict == MISMATCH and check.step == 1 and "logprobs differ" in check.describe()
    assert check_outputs([5, 6], [5, 6], ref, output_top_logprobs=same, is_exact=True).verdict == EQUAL
