"""The service level's exact rule (deterministic replicas): ids and logprobs, reuse counted on the grid.

Rows are judged from hand-made responses (pure), then a live cluster on a grid coarser than the chunk
passes with no false failure: prompts too short for a grid boundary load nothing and are no failure.
"""

from __future__ import annotations

import math

import pytest

from kvshare.outputs import compare_tokens
from kvshare.validate.report import FAIL, PASS
from kvshare.validate.service import PromptCase, ServiceConfig, _reuse_row, reusable_tokens
from kvshare.validate.service_http import Completion
from kvshare.validate.service_run import grid_of_args

IDS = [5, 9, 7]
TOPS = [[-0.1, -3.0], [-0.25, -2.0], [-0.5, -1.5]]
CASE = PromptCase("completion 60 tok", list(range(60)), "http://a", "http://b")
CONFIG = ServiceConfig(replicas=("http://a", "http://b"), chunk_tokens=16)


def completion(pool: int = 0, local: int = 0, tops=TOPS, deterministic: bool = True) -> Completion:
    provenance = {
        "replica": "r",
        "pool_tokens": pool,
        "local_tokens": local,
        "computed_tokens": 60 - pool - local,
        "deterministic": deterministic,
    }
    return Completion(
        list(IDS), [list(t) for t in tops] if tops is not None else [], None, 60, pool + local, provenance
    )


def test_reusable_tokens_round_down_to_the_chunk_then_the_grid():
    assert reusable_tokens(60, 16) == 48 and reusable_tokens(48, 16) == 32 and reusable_tokens(49, 16) == 48
    assert reusable_tokens(60, 16, 32) == 32 and reusable_tokens(60, 16, 64) == 0 and reusable_tokens(65, 16, 64) == 64
    assert reusable_tokens(1, 16) == 0 and reusable_tokens(0, 16, 32) == 0
    assert grid_of_args(("--deterministic", "--grid-tokens", "64")) == 64
    assert grid_of_args(("--grid-tokens=128",)) == 128 and grid_of_args(("--deterministic",)) is None
    with pytest.raises(ValueError, match="multiple of the chunk"):
        ServiceConfig(replicas=("http://a",), chunk_tokens=16, grid_tokens=40)


def test_a_coarse_grid_cannot_false_fail_the_pool_run():
    off = completion()
    # 60 tokens, chunk 16, grid 64: no grid boundary before the last token, so nothing is loaded, and that passes
    row, _ = _reuse_row(CONFIG, CASE, "pool", off, completion(pool=0), reusable_tokens(60, 16, 64), 64)
    assert row.status == PASS, row.detail
    # counted on the chunk instead, the same response would be a failure: the false failure the grid avoids
    row, _ = _reuse_row(CONFIG, CASE, "pool", off, completion(pool=0), reusable_tokens(60, 16), 16)
    assert row.status == FAIL and "did not load from the pool" in row.detail
    # grid 32: 32 tokens are reusable and loaded
    row, _ = _reuse_row(CONFIG, CASE, "pool", off, completion(pool=32), reusable_tokens(60, 16, 32), 32)
    assert row.status == PASS and row.figures["exact"], row.detail


def test_reuse_off_the_grid_fails():
    row, _ = _reuse_row(CONFIG, CASE, "pool", completion(), completion(pool=48), 32, 32)
    assert row.status == FAIL and "not on the grid of 32 tokens" in row.detail


def test_a_perturbed_logprob_fails_the_exact_check_and_names_both_values():
    moved = [list(t) for t in TOPS]
    moved[2][0] = math.nextafter(moved[2][0], 0.0)  # one ulp
    row, record = _reuse_row(CONFIG, CASE, "local", completion(), completion(local=48, tops=moved), 48, 16)
    assert row.status == FAIL and record["divergence_step"] == 2 and not record["passed"]
    assert row.figures["reference_logprobs"] == (-0.5, -1.5) and row.figures["logprobs"] == (moved[2][0], -1.5)
    assert "logprobs differ (both token 7)" in row.detail and f"{moved[2][0]:.9g}" in row.detail
    # the gap rule (replicas outside the mode) compares ids only: the same responses pass
    loose = _reuse_row(
        CONFIG,
        CASE,
        "local",
        completion(deterministic=False),
        completion(local=48, tops=moved, deterministic=False),
        48,
        None,
    )[0]
    assert loose.status == PASS
    assert compare_tokens(IDS, IDS, TOPS, candidate_top_logprobs=moved, is_exact=True).divergence_step == 2


def test_the_exact_rule_needs_logprobs_from_both_runs():
    row, _ = _reuse_row(CONFIG, CASE, "local", completion(), completion(local=48, tops=None), 48, 16)
    assert row.status == FAIL and "needs both runs' logprobs" in row.detail


def test_service_level_on_a_grid_coarser_than_the_chunk_passes_and_loads_on_the_grid():
    """Replicas with --deterministic --grid-tokens 32 over chunks of 16; prompts of 32, 40, 75 tokens."""
    from kvshare.validate.runner import ValidateConfig
    from kvshare.validate.service_run import run_service

    config = ValidateConfig(
        levels=("service",),
        num_replicas=2,
        service_pool_size="256MiB",
        chunk_tokens=16,
        prompt_lengths=(32, 40, 75),
        num_chat=0,
        max_tokens=4,
        seed=5,
        replica_args=("--verify-rate", "0", "--deterministic", "--grid-tokens", "32"),
    )
    result = run_service(config, "cpu")
    assert result.status == PASS, [(r.name, r.detail) for r in result.rows]
    pool = {r["case"]: r["pool"] for r in result.figures["requests"] if r["run"] == "pool"}
    # (n - 1) // 16 chunks, rounded down to 32 tokens: 32 -> 16 -> 0; 40 -> 32; 75 -> 64
    assert pool == {"completion 32 tok": 0, "completion 40 tok": 32, "completion 75 tok": 64}, pool
    assert all(r["exact"] and r["identical"] for r in result.figures["requests"])
    assert result.figures["grid_tokens"] == 32
