"""Pure parts of the remote tier: the value format, URL parsing, configuration, the circuit breaker."""

import hashlib

import pytest
import xxhash

from kvshare.pool.remote.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvshare.pool.remote.config import RemoteConfig, parse_remote_url
from kvshare.pool.remote.format import (
    CHECKSUM,
    FINGERPRINT,
    HEADER_BYTES,
    MISSING_PART,
    TRUNCATED,
    VALUE_SLACK,
    VERSION,
    BadRemoteValue,
    PageMeta,
    decode_page,
    encode_part,
    num_parts,
    part_count_of,
    part_key,
    part_payload_bytes,
)

pytestmark = pytest.mark.remote
KEY = hashlib.blake2b(b"k", digest_size=16).digest()
NS = hashlib.blake2b(b"ns", digest_size=16).digest()


def encode(page: bytes, part_bytes: int, key=KEY, namespace=NS, checksum=None) -> list[bytes]:
    meta = PageMeta(key, namespace, 3, len(page), xxhash.xxh3_64_intdigest(page) if checksum is None else checksum)
    count, step = num_parts(len(page), part_bytes), part_payload_bytes(len(page), part_bytes)
    return [encode_part(meta, i, count, i * step, page[i * step : (i + 1) * step]) for i in range(count)]


PAGE = bytes(range(256)) * 40  # 10240 bytes: no power of two >= 4 KiB divides it: parts of 4096-byte values


def reason(values, page_bytes=len(PAGE), namespace=None, key=KEY):
    with pytest.raises(BadRemoteValue) as info:
        decode_page(values, key, page_bytes, namespace)
    return info.value.reason


def test_round_trip_in_parts():
    values = encode(PAGE, 4096)
    step = 4096 - VALUE_SLACK - HEADER_BYTES
    assert [len(v) for v in values] == [4096 - VALUE_SLACK, 4096 - VALUE_SLACK, 10240 - 2 * step + HEADER_BYTES]
    page = decode_page(values, KEY, len(PAGE), NS)
    assert b"".join(page.payloads) == PAGE
    assert page.meta.depth == 3 and page.meta.namespace == NS
    assert part_count_of(values[1]) == 3


def test_absent_page_is_a_miss_not_an_error():
    assert decode_page([None, None, None], KEY, len(PAGE), None) is None


def test_every_kind_of_damage_is_named():
    values = encode(PAGE, 4096)
    flipped = bytearray(values[1])
    flipped[HEADER_BYTES + 7] ^= 0x80
    assert reason([values[0], bytes(flipped), values[2]]) == CHECKSUM
    assert reason([values[0], values[1], values[2][:-1]]) == TRUNCATED
    assert reason([values[0], values[1][: HEADER_BYTES - 1], values[2]]) == TRUNCATED
    assert reason([values[0], values[1] + b"x", values[2]]) == TRUNCATED
    assert reason([values[0], None, values[2]]) == MISSING_PART
    assert reason([None, values[1], values[2]]) == MISSING_PART
    assert reason([values[0], values[2], values[1]]) == MISSING_PART  # parts out of place
    assert reason([b"XXXX" + values[0][4:], values[1], values[2]]) == VERSION
    assert reason([values[0][:4] + b"\x07\x00" + values[0][6:], values[1], values[2]]) == VERSION
    assert reason(values, page_bytes=len(PAGE) + 1) == FINGERPRINT
    assert reason(values, namespace=bytes(16)) == FINGERPRINT
    assert reason(values, key=bytes(16)) == FINGERPRINT
    other = encode(PAGE, 4096, checksum=12345)  # another write of the same page
    assert reason([values[0], other[1], values[2]]) == MISSING_PART
    assert reason(encode(PAGE, 4096, checksum=12345)) == CHECKSUM


@pytest.mark.parametrize("page_bytes", [2 << 20, 36 << 20, 64 << 20, 3 << 20, 256 << 10])
def test_values_fill_allocator_size_classes(page_bytes):
    """Every value but the last is a power of two less the store's string header; the last is tiny."""
    part_bytes = 8 << 20
    step, count = part_payload_bytes(page_bytes, part_bytes), num_parts(page_bytes, part_bytes)
    sizes = [min(step, page_bytes - i * step) + HEADER_BYTES for i in range(count)]
    assert sum(sizes) - count * HEADER_BYTES == page_bytes
    assert all(size <= part_bytes for size in sizes)
    full = sizes[0] + VALUE_SLACK
    assert full & (full - 1) == 0 and all(s == sizes[0] for s in sizes[:-1])
    assert sizes[-1] <= 2048


def test_part_keys_share_a_hash_tag():
    assert part_key("kv", KEY, 2) == f"kv:v2:{{{KEY.hex()}}}:2"


@pytest.mark.parametrize(
    "url, cluster, nodes",
    [
        ("redis://127.0.0.1:6379", False, ()),
        ("redis://:secret@host:6380/2", False, ()),
        ("unix:///run/redis.sock", False, ()),
        ("redis+cluster://a:7000,b:7001", True, (("a", 7000), ("b", 7001))),
        ("rediss+cluster://u:p@[::1]:7000", True, (("::1", 7000),)),
    ],
)
def test_remote_urls(url, cluster, nodes):
    address = parse_remote_url(url)
    assert address.is_cluster == cluster and address.nodes == nodes
    assert "secret" not in address.display and ":p@" not in address.display


@pytest.mark.parametrize(
    "url", ["http://x:1", "redis://", "redis://h:1/abc", "redis+cluster://a", "redis+cluster://a:1/3"]
)
def test_bad_remote_urls(url):
    with pytest.raises(ValueError):
        parse_remote_url(url)


def test_config_validation():
    RemoteConfig("redis://h:1").check_lease_ttl(300)
    with pytest.raises(ValueError, match="part size"):
        RemoteConfig("redis://h:1", part_bytes=64 << 20)  # one value may not hold a whole 32B-shape page
    with pytest.raises(ValueError, match="prefix"):
        RemoteConfig("redis://h:1", prefix="a{b}")
    with pytest.raises(ValueError, match="lease-ttl"):
        RemoteConfig("redis://h:1").check_lease_ttl(10)


def test_breaker_opens_half_opens_and_closes():
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=3, reset_s=5.0, clock=lambda: now[0])
    for _ in range(2):
        breaker.record_failure()
    assert breaker.state == CLOSED
    breaker.record_success()  # a success resets the count: only consecutive failures open it
    for _ in range(3):
        breaker.record_failure()
    assert breaker.state == OPEN and not breaker.allow() and breaker.num_opens == 1
    now[0] = 4.9
    assert not breaker.allow()
    now[0] = 5.0
    assert breaker.state == HALF_OPEN and breaker.allow()
    breaker.record_failure()  # the trial failed: open again at once
    assert breaker.state == OPEN and breaker.num_opens == 2
    now[0] = 10.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == CLOSED
