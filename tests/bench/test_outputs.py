"""The bench's side of the output checks: a table row's tally, the verdicts recorded on records."""

from __future__ import annotations

import pytest

from kvshare.bench.outputs import tally
from kvshare.bench.records import Record
from kvshare.bench.runner import mark_matches
from kvshare.outputs import EQUAL, MISMATCH, NEAR_TIE, UNKNOWN, OutputCheck, check_outputs
from tests.test_outputs import REFERENCE, TOPS  # the same known answers


def test_tally_of_a_row():
    checks = [check_outputs(REFERENCE, list(REFERENCE), TOPS)] * 3 + [
        check_outputs(REFERENCE, [10, 11, 12, 77, 14], TOPS)
    ]
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
    return Record(
        run_id="r",
        experiment="ttft",
        unit="ttft/L=8",
        condition=condition,
        role=role,
        context_tokens=8,
        url="http://x",
        token_ids=token_ids,
        top_logprobs=top_logprobs,
    )


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


def test_outputs_of_deterministic_replicas_are_held_to_the_exact_rule():
    near = [10, 11, 99, 98, 97]  # parts at step 2, a near tie: the gap rule allows it
    cold = rec("cold", token_ids=REFERENCE, top_logprobs=TOPS)
    cold.deterministic = True
    exact_near, mixed = rec("cross", token_ids=near), rec("local", token_ids=near)
    exact_near.deterministic, mixed.deterministic = True, None  # mixed: a replica that does not say its mode
    mark_matches([exact_near, mixed], cold)
    assert exact_near.output_check == MISMATCH and (exact_near.reference_token, exact_near.output_token) == (12, 99)
    assert "(exact)" in exact_near.check().describe()
    assert mixed.output_check == NEAR_TIE  # not both deterministic: the gap rule
    moved = [list(step) for step in TOPS]
    moved[1][0] += 1e-6
    same_ids = rec("cross", token_ids=list(REFERENCE), top_logprobs=moved)
    same_ids.deterministic = True
    mark_matches([same_ids], cold)
    assert same_ids.output_check == MISMATCH and same_ids.first_divergence == 1  # equal ids, logprobs moved
