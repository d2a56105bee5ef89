"""A store that lies: forged bytes with a right checksum, lengths it cannot hold, a slot map naming another host.

None of it lands in a pool; each is refused where it is read, counted and logged.
"""

import logging
import socket
import ssl
import subprocess
import threading
import tracemalloc
from dataclasses import replace

import pytest
import xxhash

from kvshare.pool.client import PoolClient
from kvshare.pool.remote.breaker import CircuitBreaker
from kvshare.pool.remote.config import RemoteConfig
from kvshare.pool.remote.format import (
    CHECKSUM,
    HEADER,
    HEADER_BYTES,
    UNAUTHENTICATED,
    BadRemoteValue,
    PageMeta,
    decode_page,
    encode_part,
    page_tag,
)
from kvshare.pool.remote.reader import ReadError, StoreReader
from kvshare.pool.remote.resp import RespConnection, server_endpoint
from kvshare.pool.remote.store import RemoteStore, RemoteStoreError
from kvshare.pool.remote.workers import ERROR, fetch_pages
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
from tests.pool.remote.test_corruption import PAGE, PARTS, _lookup

pytestmark = pytest.mark.remote
PAGE_KEY = b"a page key of the pools on every host"


# -- forged bytes, authenticated pages ---------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_pools(redis_server, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "page.key"
    key_file.write_bytes(PAGE_KEY + b"\n")
    prefix = "keyed"
    with (
        two_pools(redis_server.url, prefix, "--remote-auth-key-file", str(key_file)) as (a, b),
        PoolClient(a) as ca,
        PoolClient(b) as cb,
    ):
        yield ca, cb, redis_server.client(), prefix


def _forge(value: bytes, new_checksum: int, payload_flip_at: int | None) -> bytes:
    """A part with its payload changed (or not) and the header's page checksum set, as anyone with the store can."""
    fields = list(HEADER.unpack_from(value))
    fields[8] = new_checksum
    body = bytearray(value[HEADER_BYTES:])
    if payload_flip_at is not None:
        body[payload_flip_at] ^= 0xFF
    return HEADER.pack(*fields) + bytes(body)


def test_forged_bytes_with_a_right_checksum_are_absent(keyed_pools):
    """Fails when the tag check in format.check_page is removed: B then serves the forger's bytes as chunk 1."""
    ca, cb, r, prefix = keyed_pools
    keys = make_keys("forged", 3)
    before = remote_stats(ca)
    data = write_chain(ca, keys, PAGE, "forged", NAMESPACE)
    wait_written(ca, before["written_pages"] + before["write_existing"] + 3)
    names = [f"{prefix}:v2:{{{keys[1].hex()}}}:{i}" for i in range(PARTS)]
    values = [r.get(n) for n in names]
    page = bytearray(b"".join(v[HEADER_BYTES:] for v in values))
    page[7] ^= 0xFF  # the forger's change, in part 0
    checksum = xxhash.xxh3_64_intdigest(bytes(page))
    for i, (name, value) in enumerate(zip(names, values)):
        r.set(name, _forge(value, checksum, 7 if i == 0 else None))
    lease, delta = _lookup(cb, keys)
    assert lease.num_pages == 1, "only the chunk before the forged one is served"
    assert_pages_equal(cb, lease.pages, data[:1])
    assert delta["discarded_unauthenticated"] == 1 and delta["discarded_checksum"] == 0, delta
    assert delta["deleted_values"] == 0  # not ours to judge: it stays in the store
    assert cb.lookup(keys[1:2], PAGE, lease=False).num_pages == 0  # not in B's arena
    assert r.exists(*names) == PARTS


def test_pages_tagged_under_another_key_or_none_fail_the_tag_and_a_right_tag_passes():
    page = bytes(range(256)) * 16
    meta = PageMeta(b"k" * 16, b"n" * 16, 3, 4096, xxhash.xxh3_64_intdigest(page))  # no tag
    tagged = replace(meta, tag=page_tag(PAGE_KEY, meta, [page]))
    values = lambda m: [encode_part(m, 0, 1, 0, page)]
    assert decode_page(values(tagged), meta.key, 4096, None, PAGE_KEY).payloads[0] == page
    for other in (meta, replace(meta, tag=page_tag(b"another key, as long as ours", meta, [page]))):
        with pytest.raises(BadRemoteValue) as info:
            decode_page(values(other), meta.key, 4096, None, PAGE_KEY)
        assert info.value.reason == UNAUTHENTICATED
    assert decode_page(values(meta), meta.key, 4096, None).payloads[0] == page  # no key: the store is trusted
    wrong_sum = replace(meta, checksum=meta.checksum ^ 1)
    with pytest.raises(BadRemoteValue) as info:  # our own tag over a page whose checksum is wrong: broken, not forged
        decode_page(
            values(replace(wrong_sum, tag=page_tag(PAGE_KEY, wrong_sum, [page]))), meta.key, 4096, None, PAGE_KEY
        )
    assert info.value.reason == CHECKSUM
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RemoteConfig("redis://h:1", auth_key=b"short")


# -- a fake server that lies about lengths and nodes ---------------------------------------------------


class LyingServer:
    """A RESP server on loopback: ``answer(command) -> bytes`` for each command; records when its client leaves."""

    def __init__(self, answer, tls=None) -> None:
        self.answer, self.tls = answer, tls  # tls: a server-side SSLContext
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.client_closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: socket.socket) -> None:
        conn.settimeout(60)
        if self.tls is not None:
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except OSError:  # a client that refused our certificate
                conn.close()
                return
        buffer = b""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    self.client_closed.set()
                    return
                buffer += data
                while True:
                    command, buffer = _parse_command(buffer)
                    if command is None:
                        break
                    try:
                        conn.sendall(self.answer(command))
                    except OSError:  # the client closed its end while answers were still going out
                        self.client_closed.set()
                        return

    def close(self) -> None:
        self.sock.close()


def _parse_command(buffer: bytes):
    """(one RESP array command as a list of bytes, the rest), or (None, buffer) when it is not all there."""
    if not buffer.startswith(b"*") or b"\r\n" not in buffer:
        return None, buffer
    head, rest = buffer.split(b"\r\n", 1)
    args = []
    for _ in range(int(head[1:])):
        if b"\r\n" not in rest:
            return None, buffer
        length_line, rest = rest.split(b"\r\n", 1)
        n = int(length_line[1:])
        if len(rest) < n + 2:
            return None, buffer
        args.append(rest[:n])
        rest = rest[n + 2 :]
    return args, rest


def test_a_length_the_store_cannot_hold_fails_the_read_before_anything_is_allocated(caplog):
    """Fails when RESP lengths are taken as given: the reader then allocates the 256 MiB it was promised and waits
    for them until its timeout (the server sends no more)."""
    server = LyingServer(lambda command: b"$%d\r\n" % (256 * MiB) + b"x" * 100)
    cfg = RemoteConfig(f"redis://127.0.0.1:{server.port}", prefix="lie", part_bytes=256 << 10, timeout_s=30)
    store = RemoteStore(cfg.address, 30)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvshare.pool.remote"):
            result = fetch_pages(store, CircuitBreaker(3, 1.0), cfg, make_keys("lie", 2), 1 * MiB, NAMESPACE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        store.close()
    assert result.end == ERROR and result.num_errors == 1 and not result.pages
    assert peak < 16 * MiB, f"{peak} bytes allocated for a lie"
    assert "announced a value 268435456 long" in caplog.text
    assert server.client_closed.wait(10), "the reader keeps a connection that is out of step"
    server.close()


def test_a_slot_map_naming_another_host_is_refused(caplog):
    """Fails when CLUSTER SLOTS is followed to any host: the reader then connects to 203.0.113.9 (and times out)."""

    def answer(command):
        if command[:2] == [b"CLUSTER", b"SLOTS"]:
            return b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$11\r\n203.0.113.9\r\n:6379\r\n"
        return b"-ERR unexpected\r\n"

    server = LyingServer(answer)
    reader = StoreReader(RemoteConfig(f"redis+cluster://127.0.0.1:{server.port}").address, 0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="kvshare.pool.remote"), pytest.raises(ReadError) as info:
            reader.get(["lie:{x}:0"])
        assert "names node 203.0.113.9:6379, which is not among the configured nodes" in str(info.value)
        assert "not among the configured nodes" in caplog.text
        allowed = StoreReader(
            RemoteConfig(f"redis+cluster://127.0.0.1:{server.port}").address, 0.5, allowed_hosts=("203.0.113.9",)
        )
        allowed.check_node("203.0.113.9", 6379)  # an allow-listed host passes
        allowed.close()
    finally:
        reader.close()
        server.close()


def test_redis_py_writes_go_only_to_nodes_the_reader_allows(redis_cluster, monkeypatch):
    """Fails when the cluster client is built without address_remap: its writes then follow any slot map."""
    url, servers = redis_cluster
    store = RemoteStore(RemoteConfig(url).address, 5.0)
    try:
        store.put(["lie:{a}:0"], [b"x"])  # the configured nodes: allowed
        assert store.get(["lie:{a}:0"], 0, 16) == [b"x"]
    finally:
        store.close()
    store = RemoteStore(RemoteConfig(url).address, 5.0)
    refused_port = servers[1].port

    def check_node(host, port):
        if port == refused_port:
            raise ValueError(f"the cluster names node {host}:{port}, which is not among the configured nodes")

    monkeypatch.setattr(store._reader, "check_node", check_node)
    try:
        with pytest.raises(RemoteStoreError, match="not among the configured nodes"):
            store.put([f"lie:{{{i}}}:0" for i in range(50)], [b"x"] * 50)  # keys on every node
    finally:
        store.close()


def test_tls_checks_the_server_against_the_given_ca_and_the_password_comes_from_apart(tmp_path):
    """Fails when ?ssl_ca_certs is ignored (the system's CAs refuse the server) or RemoteConfig.password does not
    reach AUTH."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    seen = []

    def answer(command):
        seen.append(command)
        return b"+OK\r\n" if command[0] == b"AUTH" else b"+PONG\r\n"

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = LyingServer(answer, tls=context)

    url = f"rediss://kv@127.0.0.1:{server.port}/0?ssl_ca_certs={cert}"
    connection = RespConnection(server_endpoint(RemoteConfig(url, password="s3cret").address), 5.0)
    assert connection.execute([("PING",)]) == [b"PONG"]
    connection.close()
    assert seen[0] == [b"AUTH", b"kv", b"s3cret"]
    with pytest.raises(ssl.SSLError):  # the system's CAs do not know the server
        RespConnection(server_endpoint(RemoteConfig(url.split("?")[0], password="s3cret").address), 5.0)
    with pytest.raises(ValueError, match="give it once"):
        RemoteConfig(f"rediss://kv:other@127.0.0.1:{server.port}", password="s3cret")
    server.close()
