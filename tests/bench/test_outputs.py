"""Output checks with known answers: equal, a near tie (allowed), a mismatch (never passed off as equal)."""

from __future__ import annotations

import pytest

from kvshare.bench.outputs import EQUAL, MISMATCH, NEAR_TIE, UNKNOWN, OutputCheck, check_outputs, tally
from kvshare.bench.records import Record
from kvshare.bench.runner import mark_matches

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


def test_tally_of_a_row():
    checks = [check_outputs(REFERENCE, list(REFERENCE), TOPS)] * 3 + [check_outputs(REFERENCE, [10, 11, 12, 77, 14], TOPS)]
    assert str(tally(checks + [None])) == "equal 3/4; near-tie 0; mismatch 1 (step 3, gap 0.031)"
    assert not tally(checks).is_clean
    near = check_outputs(REFERENCE, [10, 11, 99, 98, 97], TOPS)
    assert str(tally([near, OutputCheck(EQUAL)])) == "equal 1/2; near-tie 1 (step 2, gap 0.0005); mismatch 0"
    assert tally([near, OutputCheck(EQUAL)]).is_clean
    assert str(tally([OutputCheck(UNKNOWN, 13)])) == "equal 0/1; near-tie 0; mismatch 0; gap unknown 1 (step 13)"
    assert str(tally([])) == "-"
    many = [check_outputs([1], [2], [[-1.0, -2.0]])] * 5
    assert str(tally(many)).endswith("mismatch 5 (step 0, gap 1; step 0, gap 1; step 0, gap 1; ...)")


def rec(condition: str, role: str = "measure", token_ids=None, top_logprobs=None) -> Record:
    return Record(run_id="r", experiment="ttft", unit="ttft/L=8", condition=condition, role=role, context_tokens=8,
                  url="http://x", token_ids=token_ids, top_logprobs=top_logprobs)


def test_mark_matches_records_the_verdict_the_gap_and_the_tokens():
    cold = rec("cold", token_ids=REFERENCE, top_logprobs=TOPS)
    local, cross = rec("local", token_ids=list(REFERENCE)), rec("cross", token_ids=[10, 11, 12, 77, 14])
    mark_matches([local, cross], cold)
    assert (local.output_check, local.matches_reference, local.first_divergence) == (EQUAL, True, None)
    assert (cross.output_check, cross.matches_reference, cross.first_divergence) == (MISMATCH, False, 3)
    assert cross.divergence_gap == pytest.approx(0.031) and (cross.reference_token, cross.output_token) == (13, 77)
    assert cross.compared_with == "cold" and cross.check() == check_outputs(REFERENCE, cross.token_ids, TOPS)
    verify = rec("on", role="verify", token_ids=REFERENCE, top_logprobs=TOPS)
    measured = rec("on", token_ids=[10, 11, 99, 98, 97])
    mark_matches([measured], verify)
    assert measured.output_check == NEAR_TIE and measured.compared_with == "verify"
    assert cold.output_check is None  # the reference itself is not compared


def test_a_failed_request_is_not_compared():
    cold, failed = rec("cold", token_ids=REFERENCE, top_logprobs=TOPS), rec("cross")
    mark_matches([failed], cold)
    assert failed.check() is None and failed.matches_reference is None


def test_records_of_the_previous_version_read_as_equal_or_gap_unknown():
    """Before the output check, records carried matches_reference and first_divergence only."""
    old_equal, old_parted = rec("local"), rec("cross")
    old_equal.matches_reference = True
    old_parted.matches_reference, old_parted.first_divergence = False, 13
    assert old_equal.check() == OutputCheck(EQUAL)
    assert old_parted.check() == OutputCheck(UNKNOWN, 13)
    assert rec("cold").check() is None
