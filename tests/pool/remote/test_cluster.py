"""The same sharing through a three-node Redis cluster: a page's parts share one node, pages spread over all."""

import pytest

from kvshare.pool.client import PoolClient
from kvshare.pool.remote.format import num_parts, part_keys
from tests.pool.remote.conftest import (
    MiB,
    assert_pages_equal,
    make_keys,
    remote_stats,
    two_pools,
    wait_written,
    write_chain,
)

pytestmark = pytest.mark.remote


def test_pages_written_through_a_are_read_through_b_via_cluster(redis_cluster, prefix):
    url, servers = redis_cluster
    page_bytes = 1 * MiB
    keys = make_keys(prefix, 12)
    with two_pools(url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        data = write_chain(ca, keys, page_bytes, prefix)
        wait_written(ca, 12)
        lease = cb.lookup(keys, page_bytes)
        assert lease.num_pages == 12
        assert_pages_equal(cb, lease.pages, data)
        cb.release([lease.lease_id], wait=True)
        cb.check_integrity()
        assert remote_stats(cb)["promoted_pages"] == 12 and remote_stats(cb)["errors"] == 0
    held = [{k.decode() for k in s.client().keys(f"{prefix}:*")} for s in servers]  # KEYS is node-local
    nodes_of_page = []
    for key in keys:
        holders = {
            i
            for i, keys_of_node in enumerate(held)
            for k in part_keys(prefix, key, num_parts(page_bytes, 256 << 10))
            if k in keys_of_node
        }
        assert len(holders) == 1, "all parts of a page live on one node (hash tag)"
        nodes_of_page.append(holders.pop())
    assert len(set(nodes_of_page)) >= 2, "pages spread over the cluster's nodes"


def test_cluster_remote_miss_and_partial_prefix(redis_cluster, prefix):
    url, _ = redis_cluster
    page_bytes = 256 << 10  # one part per page
    keys = make_keys(prefix, 5)
    with two_pools(url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        data = write_chain(ca, keys[:3], page_bytes, prefix)
        wait_written(ca, 3)
        lease = cb.lookup(keys, page_bytes)
        assert lease.num_pages == 3
        assert_pages_equal(cb, lease.pages, data)
        cb.release([lease.lease_id], wait=True)
        stats = remote_stats(cb)
        assert stats["hit_chunks"] == 3 and stats["miss_chunks"] == 2
