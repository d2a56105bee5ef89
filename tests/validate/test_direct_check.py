"""The bytes level's direct-lookup rows (kvshare.validate.direct_check)."""

import pytest

from kvshare.pool.direct import is_supported
from kvshare.validate.checked_pool import CheckedPool, PoolSpec
from kvshare.validate.direct_check import direct_rows
from kvshare.validate.report import CAUGHT, FAIL, PASS, SKIP


@pytest.fixture
def pool():
    with CheckedPool(PoolSpec(None, 64 << 20, 8 << 20), "cpu") as s:
        yield s


@pytest.mark.skipif(not is_supported(), reason="no direct lookups here (x86-64 Linux with membarrier only)")
def test_a_direct_lease_passes_and_its_control_is_caught(pool):
    rows = {r.name: r for r in direct_rows(pool)}
    assert rows["direct lookup"].status == PASS, rows["direct lookup"].detail
    assert rows["direct lookup control"].status == CAUGHT
    assert pool.client.stats()["used_bytes"] == 0  # the check's pages are dropped again


@pytest.mark.skipif(not is_supported(), reason="no direct lookups here (x86-64 Linux with membarrier only)")
def test_a_direct_lease_naming_the_wrong_pages_fails(pool, monkeypatch):
    """Negative control: a directory read that swaps two pages' headers must fail the row."""
    from kvshare.pool.direct_reader import DirectLeases

    original = DirectLeases._lookup

    def swapped(self, keys, page_bytes):
        grant = original(self, keys, page_bytes)
        if grant is not None:
            grant.pages[0], grant.pages[1] = grant.pages[1], grant.pages[0]
        return grant

    monkeypatch.setattr(DirectLeases, "_lookup", swapped)
    rows = {r.name: r for r in direct_rows(pool)}
    assert rows["direct lookup"].status == FAIL


def test_a_pool_without_the_directory_is_reported_skipped(monkeypatch):
    from kvshare.pool import direct

    monkeypatch.setattr(direct, "register_client", lambda: False)  # this process cannot be reached by the barrier
    monkeypatch.setattr("kvshare.pool.client.register_client", lambda: False)
    with CheckedPool(PoolSpec(None, 64 << 20, 8 << 20), "cpu") as pool:
        rows = direct_rows(pool)
    assert [r.status for r in rows] == [SKIP]
