"""kvshare validate --level isolation: its checks see a leak when there is one, and pass on a shared deployment."""

import pytest

from kvshare.validate.isolation import Answer, isolation_rows, run_isolation_level
from kvshare.validate.report import FAIL, PASS

SHOWN = {
    "kvshare": {"replica": "replica0", "local_tokens": 512, "pool_tokens": 0},
    "usage": {"prompt_tokens_details": {"cached_tokens": 512}},
}
NOTHING_REUSED = {
    "kvshare": {"replica": "replica1", "local_tokens": 0, "pool_tokens": 0},
    "usage": {"prompt_tokens_details": {"cached_tokens": 0}},
}
WITHHELD = {"kvshare": {}, "usage": {"prompt_tokens_details": None}}


def _verdicts(owner=SHOWN, other=NOTHING_REUSED, other_headers=None, shared=WITHHELD, namespaces=("a1", "b2")):
    rows = isolation_rows(Answer(owner, {}), Answer(other, other_headers or {}), Answer(shared, {}), namespaces)
    return [r.status for r in rows]


def test_each_leak_fails_its_own_row():
    assert _verdicts() == [PASS] * 5
    assert _verdicts(owner=NOTHING_REUSED)[0] == FAIL  # a control that reused nothing proves nothing
    assert _verdicts(other=SHOWN)[1] == FAIL  # tenant b served tenant a's KV
    assert _verdicts(other=WITHHELD)[1] == FAIL  # no provenance to judge by is no proof either
    assert _verdicts(other_headers={"X-KVShare-Replica": "http://127.0.0.1:8081"})[2] == FAIL
    assert _verdicts(shared=SHOWN)[3] == FAIL  # a shared namespace's repeat shows it was sent before
    assert _verdicts(shared={"kvshare": {}, "usage": {"prompt_tokens_details": {"cached_tokens": 0}}})[3] == FAIL
    assert _verdicts(namespaces=("same", "same"))[4] == FAIL


@pytest.mark.slow
def test_the_level_passes_on_a_cluster_of_the_tiny_model():
    """The positive run; test_each_leak_fails_its_own_row shows each check failing on the answer a leak gives
    (the untenanted repeat's provenance and the replica header were what every response carried before)."""
    result = run_isolation_level("tiny", "cpu", "256MiB", ("--chunk-tokens", "64"), timeout_s=300)
    assert result.status == PASS, [(r.name, r.status, r.detail) for r in result.rows] or result.error
