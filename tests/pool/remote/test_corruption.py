"""Broken remote values are caught, counted and never used: checksum, truncation, version, fingerprint, missing part."""

import struct

import pytest

from kvshare.pool.client import PoolClient
from kvshare.pool.remote.format import HEADER, HEADER_BYTES, num_parts, part_keys
from tests.pool.remote.conftest import (
    NAMESPACE,
    MiB,
    assert_pages_equal,
    make_keys,
    remote_stats,
    two_pools,
    wait_written,
    write_chain,
)

pytestmark = pytest.mark.remote
PAGE = 1 * MiB
PARTS = num_parts(PAGE, 256 << 10)  # the tests' pools use --remote-part-size 256KiB: 5 parts


@pytest.fixture(scope="module")
def pools(redis_server):
    prefix = "corrupt"
    with two_pools(redis_server.url, prefix) as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
        yield ca, cb, redis_server.client(), prefix


def _written(pools, tag, n=3, namespace=NAMESPACE):
    ca, _, _, prefix = pools
    keys = make_keys(tag, n)
    before = remote_stats(ca)
    data = write_chain(ca, keys, PAGE, tag, namespace)
    wait_written(ca, before["written_pages"] + before["write_existing"] + n)
    return keys, data


def _lookup(cb, keys):
    """Pages B serves for ``keys`` and the change of its remote counters."""
    before = remote_stats(cb)
    lease = cb.lookup(keys, PAGE)
    after = remote_stats(cb)
    cb.release([lease.lease_id], wait=True)
    cb.check_integrity()
    return lease, {k: after[k] - before[k] for k in after if isinstance(after[k], int)}


def _mangle(r, key_name, fn):
    r.set(key_name, fn(r.get(key_name)))


def _expect_discard(pools, keys, data, bad_index, reason, deleted):
    _, cb, r, prefix = pools
    lease, delta = _lookup(cb, keys)
    assert lease.num_pages == bad_index, "only the chunks before the bad one are served"
    assert_pages_equal(cb, lease.pages, data[:bad_index])
    assert delta[f"discarded_{reason}"] == 1, delta
    assert (
        sum(delta[f"discarded_{x}"] for x in ("checksum", "version", "fingerprint", "truncated", "missing_part")) == 1
    )
    assert delta["promoted_pages"] == bad_index and delta["deleted_values"] == deleted
    assert cb.lookup(keys[bad_index : bad_index + 1], PAGE, lease=False).num_pages == 0  # not in B's arena
    num_left = r.exists(*part_keys(prefix, keys[bad_index], PARTS))
    assert num_left == 0 if deleted else num_left > 0  # broken values go; foreign or partial ones stay


def test_flipped_byte_fails_the_checksum(pools):
    keys, data = _written(pools, "flip")
    r, prefix = pools[2], pools[3]

    def flip(value):
        b = bytearray(value)
        b[HEADER_BYTES + 1000] ^= 0x01
        return bytes(b)

    _mangle(r, part_keys(prefix, keys[1], PARTS)[2], flip)
    _expect_discard(pools, keys, data, 1, "checksum", deleted=1)


def test_truncated_part(pools):
    keys, data = _written(pools, "trunc")
    r, prefix = pools[2], pools[3]
    _mangle(r, part_keys(prefix, keys[0], PARTS)[3], lambda v: v[:-100])
    _expect_discard(pools, keys, data, 0, "truncated", deleted=1)


def test_value_shorter_than_its_header(pools):
    keys, data = _written(pools, "stub")
    r, prefix = pools[2], pools[3]
    _mangle(r, part_keys(prefix, keys[2], PARTS)[1], lambda v: v[:10])
    _expect_discard(pools, keys, data, 2, "truncated", deleted=1)


def test_wrong_format_version(pools):
    keys, data = _written(pools, "version")
    r, prefix = pools[2], pools[3]
    _mangle(r, part_keys(prefix, keys[1], PARTS)[0], lambda v: v[:4] + struct.pack("<H", 99) + v[6:])
    _expect_discard(pools, keys, data, 1, "version", deleted=1)


def test_value_under_another_chunks_key(pools):
    keys, data = _written(pools, "moved")
    other, _ = _written(pools, "moved-other", n=1)
    r, prefix = pools[2], pools[3]
    for src, dst in zip(part_keys(prefix, other[0], PARTS), part_keys(prefix, keys[1], PARTS)):
        r.set(dst, r.get(src))
    _expect_discard(pools, keys, data, 1, "fingerprint", deleted=0)


def test_other_page_size_is_a_fingerprint_mismatch(pools):
    keys, _ = _written(pools, "size")
    _, cb, _, _ = pools
    before = remote_stats(cb)
    lease = cb.lookup(keys, PAGE // 2)  # as if another layout asked for the same chunks
    assert lease.num_pages == 0
    assert remote_stats(cb)["discarded_fingerprint"] - before["discarded_fingerprint"] == 1


def test_chunk_of_another_namespace_does_not_extend_a_chain(pools):
    ca, cb, _, _ = pools
    keys = make_keys("ns", 2)
    other_ns = bytes(16)
    before = remote_stats(ca)
    data = write_chain(ca, keys[:1], PAGE, "ns")
    write_chain(ca, keys[1:], PAGE, "ns", namespace=other_ns, first_depth=1)
    wait_written(ca, before["written_pages"] + before["write_existing"] + 2)
    _expect_discard(pools, keys, data, 1, "fingerprint", deleted=0)


def test_missing_part(pools):
    keys, data = _written(pools, "missing")
    r, prefix = pools[2], pools[3]
    r.delete(part_keys(prefix, keys[1], PARTS)[3])
    _expect_discard(pools, keys, data, 1, "missing_part", deleted=0)


def test_missing_first_part(pools):
    keys, data = _written(pools, "missing0")
    r, prefix = pools[2], pools[3]
    r.delete(part_keys(prefix, keys[0], PARTS)[0])
    _expect_discard(pools, keys, data, 0, "missing_part", deleted=0)


def test_parts_of_two_writes_are_torn(pools):
    keys, data = _written(pools, "torn")
    r, prefix = pools[2], pools[3]

    def other_checksum(value):
        fields = list(HEADER.unpack_from(value))
        fields[8] ^= 1  # the page checksum another write of this page would carry
        return HEADER.pack(*fields) + value[HEADER_BYTES:]

    _mangle(r, part_keys(prefix, keys[2], PARTS)[1], other_checksum)
    _expect_discard(pools, keys, data, 2, "missing_part", deleted=0)


def test_a_replaced_broken_value_is_served_again(pools):
    """After a broken value was deleted, the next writer's copy is used (writers skip complete pages only)."""
    ca, cb, r, prefix = pools
    keys, data = _written(pools, "heal", n=1)
    _mangle(r, part_keys(prefix, keys[0], PARTS)[0], lambda v: v[:-1])
    assert _lookup(cb, keys)[0].num_pages == 0
    ca.drop(keys)
    before = remote_stats(ca)
    write_chain(ca, keys, PAGE, "heal")
    after = wait_written(ca, before["written_pages"] + before["write_existing"] + 1)
    assert after["written_pages"] == before["written_pages"] + 1
    lease, _ = _lookup(cb, keys)
    assert lease.num_pages == 1
