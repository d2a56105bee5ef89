"""The data path's RESP reader and the in-place fetch, against real redis-servers (one, and a cluster)."""

import hashlib
import random
import time

import numpy as np
import pytest
import xxhash

from kvshare.pool.remote.breaker import CircuitBreaker
from kvshare.pool.remote.config import RemoteConfig, parse_remote_url
from kvshare.pool.remote.direct import fetch_into
from kvshare.pool.remote.format import (
    CHECKSUM,
    FINGERPRINT,
    HEADER_BYTES,
    MISSING_PART,
    TRUNCATED,
    VERSION,
    PageMeta,
    encode_part,
    num_parts,
    part_keys,
    part_payload_bytes,
)
from kvshare.pool.remote.reader import StoreReader, key_slot
from kvshare.pool.remote.resp import RespConnection, RespError, server_endpoint
from kvshare.pool.remote.store import RemoteStore
from kvshare.pool.remote.workers import MISS

pytestmark = pytest.mark.remote
PAGE = 64 << 10
PART = 16 << 10  # 5 values per page: 4 of 16 KiB - 64 B and a short last one
NS = hashlib.blake2b(b"reader-tests", digest_size=16).digest()


def test_key_slot_is_the_clusters():
    from redis.crc import key_slot as redis_key_slot

    rng = random.Random(0)
    for _ in range(200):
        key = "".join(rng.choice("ab{}:0123") for _ in range(rng.randint(0, 12)))
        assert key_slot(key) == redis_key_slot(key.encode()), key


def test_replies_of_every_kind_and_bulk_values_in_place(redis_server):
    r = redis_server.client()
    big = np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8).tobytes()  # spans many reads
    r.set("rd:big", big)
    r.set("rd:small", b"xyz")
    r.rpush("rd:list", b"a")
    c = RespConnection(server_endpoint(parse_remote_url(redis_server.url)), 5.0)
    try:
        assert c.execute([("PING",), ("GET", "rd:none"), ("EXISTS", "rd:small", "rd:none"), ("GET", "rd:small")]) == [
            b"PONG",
            None,
            1,
            b"xyz",
        ]
        assert isinstance(c.execute([("GET", "rd:list")])[0], RespError)
        dest = np.zeros(len(big), dtype=np.uint8)
        heads = []

        def place(head, rest):
            heads.append(head)
            return memoryview(dest)[len(head) : len(head) + rest]

        c.send([("GET", "rd:big"), ("GET", "rd:small"), ("GET", "rd:none"), ("GET", "rd:big")])
        n = len(big)
        assert c.read_bulk_into(100, place, n) == n
        assert c.read_bulk_into(100, lambda head, rest: None, n) == 3  # dropped
        assert c.read_bulk_into(100, place, n) is None
        assert c.read_bulk_into(100, lambda head, rest: None, n) == n  # dropped; the stream stays in step
        assert heads[0] == big[:100] and dest[100:].tobytes() == big[100:]
        assert c.execute([("GET", "rd:small")]) == [b"xyz"]
    finally:
        c.close()


def test_reads_spread_over_cluster_nodes_and_follow_a_moved_slot(redis_cluster):
    from redis.cluster import RedisCluster

    url, servers = redis_cluster
    keys = [f"rd:{{{i}}}:0" for i in range(60)]
    writer = RedisCluster(host="127.0.0.1", port=servers[0].port)
    reader = StoreReader(parse_remote_url(url), 5.0)
    try:
        for key in keys:
            writer.set(key, key.encode() * 100)
        assert [bytes(v) for v in reader.get(keys)] == [k.encode() * 100 for k in keys]
        assert len(reader._by_node(list(range(len(keys))), keys, None)) == 3, "the keys span every node"
        reader._slots = [reader._slots[0]] * len(reader._slots)  # a stale map: every slot on one node
        assert [bytes(v) for v in reader.get(keys)] == [k.encode() * 100 for k in keys]  # MOVED: map read again
        assert reader.get(["rd:{absent}:0"]) == [None]
    finally:
        reader.close()
        writer.close()


# -- pages fetched into place ------------------------------------------------------------------


def _page(i: int) -> bytes:
    return np.random.default_rng(100 + i).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


def _key(tag: str, i: int) -> bytes:
    return hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest()


def _store_pages(r, prefix: str, tag: str, n: int, part_bytes: int = PART) -> list[bytes]:
    pages = [_page(i) for i in range(n)]
    for i, page in enumerate(pages):
        meta = PageMeta(_key(tag, i), NS, 10 + i, PAGE, xxhash.xxh3_64_intdigest(page))
        count, step = num_parts(PAGE, part_bytes), part_payload_bytes(PAGE, part_bytes)
        for j, name in enumerate(part_keys(prefix, meta.key, count)):
            r.set(name, encode_part(meta, j, count, j * step, page[j * step : (j + 1) * step]))
    return pages


def _fetch(url, prefix, tag, n, first_depth=10, part_bytes=PART):
    cfg = RemoteConfig(url, prefix=prefix, part_bytes=part_bytes)
    store = RemoteStore(cfg.address, 5.0)
    arena = np.zeros((n + 1) * PAGE, dtype=np.uint8)
    offsets = [(i + 1) * PAGE for i in range(n)]  # not the pages' own order in the store: any reserved page
    try:
        result = fetch_into(
            store,
            CircuitBreaker(3, 60),
            cfg,
            arena,
            [(_key(tag, i), o) for i, o in enumerate(offsets)],
            PAGE,
            NS,
            first_depth,
            deadline=time.monotonic() + 30,
        )
    finally:
        store.close()
    return result, [arena[o : o + PAGE].tobytes() for o in offsets]


def test_pages_land_in_place_with_their_checksums(redis_server, prefix):
    r = redis_server.client()
    pages = _store_pages(r, prefix, "ok", 4)
    result, landed = _fetch(redis_server.url, prefix, "ok", 5)  # the fifth is not stored
    assert result.end == MISS and landed[:4] == pages
    assert result.checksums == [xxhash.xxh3_64_intdigest(p) for p in pages]
    small = _store_pages(r, prefix + "s", "small", 2, part_bytes=4096)  # written with more, smaller parts
    result, landed = _fetch(redis_server.url, prefix + "s", "small", 2)
    assert result.end is None and landed == small


@pytest.mark.parametrize(
    "damage, reason, is_deleted",
    [
        (
            lambda v: v[: HEADER_BYTES + 1000] + bytes([v[HEADER_BYTES + 1000] ^ 1]) + v[HEADER_BYTES + 1001 :],
            CHECKSUM,
            True,
        ),
        (lambda v: v[:-100], TRUNCATED, True),
        (lambda v: v + b"more", TRUNCATED, True),
        (lambda v: v[: HEADER_BYTES - 1], TRUNCATED, True),
        (lambda v: b"XXXX" + v[4:], VERSION, True),
        (lambda v: v[:4] + b"\x09\x00" + v[6:], VERSION, True),
        (None, MISSING_PART, False),
    ],
)
def test_every_kind_of_damage_is_caught_in_place(redis_server, prefix, damage, reason, is_deleted):
    r = redis_server.client()
    pages = _store_pages(r, prefix, "bad", 3)
    name = part_keys(prefix, _key("bad", 1), num_parts(PAGE, PART))[2]
    if damage is None:
        r.delete(name)
    else:
        r.set(name, damage(r.get(name)))
    result, landed = _fetch(redis_server.url, prefix, "bad", 3)
    assert result.end == reason and len(result.checksums) == 1 and landed[0] == pages[0]
    assert [d[0] for d in result.discarded] == [reason]
    assert result.num_deleted == is_deleted
    assert (r.exists(*part_keys(prefix, _key("bad", 1), num_parts(PAGE, PART))) == 0) == is_deleted


def test_a_page_of_another_depth_or_namespace_is_foreign(redis_server, prefix):
    r = redis_server.client()
    _store_pages(r, prefix, "deep", 2)
    result, _ = _fetch(redis_server.url, prefix, "deep", 2, first_depth=11)
    assert result.end == FINGERPRINT and result.checksums == [] and result.num_deleted == 0


def _trickling_server(first: bytes):
    """A server that answers every connection with ``first``, then one byte every 50 ms for 3 s, then closes."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                conn.recv(1 << 16)
                conn.sendall(first)
                for _ in range(60):
                    time.sleep(0.05)
                    conn.sendall(b"x")
            except OSError:
                pass
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener


@pytest.mark.parametrize("first", [b"-ERR ", b"$100000\r\n"], ids=["set-up reply", "value"])
def test_no_receive_runs_past_the_deadline_however_the_store_trickles(first):
    """Each byte comes well inside the 0.5 s timeout, so only a deadline ends the read. Fails when the set-up
    (AUTH) or a value is received without one: the call then lasts as long as the store keeps trickling."""
    from kvshare.pool.remote.resp import Endpoint

    listener = _trickling_server(first)
    endpoint = Endpoint("127.0.0.1", listener.getsockname()[1], password="x" if first[:1] == b"-" else None)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            connection = RespConnection(endpoint, 0.5, deadline=started + 0.3)
            connection.send([("GET", "k")])
            connection.read_bulk_into(4, lambda head, rest: memoryview(bytearray(rest)), 1 << 20)
        assert time.monotonic() - started < 1.0
    finally:
        listener.close()
