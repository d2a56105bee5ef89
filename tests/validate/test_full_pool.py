from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool
from kvshare.validate.full_pool import check_full_pool


def test_full_pool_every_page_and_negative_control():
    with running_pool("48MiB", ("--extent-size", "16MiB"), quiet=True) as path, PoolClient(path) as client:
        phases = []
        result = check_full_pool(client, 2 << 20, progress=lambda phase, i, n: phases.append(phase))
        assert result.passed and result.num_pages == 24 == result.expected_pages
        assert {"fault-in", "write", "verify"} <= set(phases)
        assert set(result.seconds) == {"fault_in", "write", "verify"}
        assert client.stats()["used_bytes"] == 0  # everything handed back
        bad = check_full_pool(client, 2 << 20, corrupt_page=5)
        assert not bad.passed and bad.bad_pages == [5]
        client.check_integrity()


def test_full_pool_with_page_not_dividing_the_extent():
    with running_pool("40MiB", ("--extent-size", "16MiB"), quiet=True) as path, PoolClient(path) as client:
        result = check_full_pool(client, 3 << 20)  # 5 + 5 + 2 pages in extents of 16, 16, 8 MiB
        assert result.passed and result.num_pages == 12
