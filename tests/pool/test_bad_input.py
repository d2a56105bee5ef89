"""Bad input gets an error reply (or the offending connection closed); everyone else keeps being served."""

import mmap
import os
import socket
import stat
import subprocess
import sys
import urllib.request

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.pool import protocol as P
from kvshare.pool.arena import hugepages_free_bytes
from kvshare.pool.client import PoolClient, PoolRequestError
from kvshare.pool.spawn import running_pool
from tests.pool import workers
from tests.pool.conftest import MiB, free_port, make_keys


class RawClient:
    """Speaks frames by hand, to send what PoolClient never would."""

    def __init__(self, path, hello=True, version=P.PROTOCOL_VERSION):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self.buf = bytearray()
        if hello:
            self.send_frame(msgspec.msgpack.encode(P.Hello(protocol_version=version)))
            self.hello = self.reply()

    def send_frame(self, payload: bytes):
        self.sock.sendall(P.FRAME_HEADER.pack(len(payload)) + payload)

    def reply(self):
        while True:
            frames = P.split_frames(self.buf, 1 << 30)
            if frames:
                return P.decode_reply(frames[0])
            data = self.sock.recv(65536)
            if not data:
                return None  # closed by the daemon
            self.buf += data


def healthy(path):
    """A well-behaved client still gets served, and the daemon's invariants hold."""
    with PoolClient(path) as client:
        assert client.lookup(make_keys("health", 2), 1 * MiB).lease_id >= 0
        client.check_integrity()
        return client.stats()


def test_malformed_unknown_and_wrong_type_messages_get_errors(shared_pool):
    raw = RawClient(shared_pool)
    for payload in (
        b"\xc1garbage",
        msgspec.msgpack.encode({"type": "no_such_message"}),
        msgspec.msgpack.encode({"type": "lookup", "keys": "not a list", "page_bytes": 1}),
        msgspec.msgpack.encode({"type": "lookup", "page_bytes": 1}),  # missing field
        msgspec.msgpack.encode({"type": "hello", "protocol_version": 1}),  # hello twice
    ):
        raw.send_frame(payload)
        reply = raw.reply()
        assert isinstance(reply, P.ErrorReply), payload
    raw.send_frame(msgspec.msgpack.encode(P.GetStats()))
    assert isinstance(raw.reply(), P.StatsReply)  # the same connection still works
    healthy(shared_pool)


def test_oversized_frame_closes_only_that_connection(shared_pool):
    raw = RawClient(shared_pool)
    raw.sock.sendall(P.FRAME_HEADER.pack(64 << 20) + b"x" * 100)
    reply = raw.reply()
    assert isinstance(reply, P.ErrorReply) and reply.code == "protocol"
    assert raw.reply() is None
    healthy(shared_pool)


def test_wrong_version_and_missing_hello(shared_pool):
    raw = RawClient(shared_pool, version=P.PROTOCOL_VERSION + 7)
    assert isinstance(raw.hello, P.ErrorReply) and raw.hello.code == "version_mismatch"
    assert "protocol" in raw.hello.message
    raw = RawClient(shared_pool, hello=False)
    raw.send_frame(msgspec.msgpack.encode(P.GetStats()))
    reply = raw.reply()
    assert isinstance(reply, P.ErrorReply) and reply.code == "hello_required"
    healthy(shared_pool)


def test_other_clients_reservations_and_leases_are_not_yours(shared_pool):
    workers.write_pages(shared_pool, "owned", 2, 1 * MiB)
    with PoolClient(shared_pool) as a, PoolClient(shared_pool) as b:
        res = a.reserve(b"o" * 16, make_keys("owned-new", 1), 1 * MiB)
        lease = a.lookup(make_keys("owned", 2), 1 * MiB)
        for call in (
            lambda: b.commit(res.reservation_id, [0]),
            lambda: b.abort(res.reservation_id),
            lambda: b.release([lease.lease_id], wait=True),
        ):
            with pytest.raises(PoolRequestError) as err:
                call()
            assert err.value.code == "not_owner"
        a.commit(res.reservation_id, [0])
        with pytest.raises(PoolRequestError):
            a.commit(res.reservation_id, [0])  # double commit
        with pytest.raises(PoolRequestError) as err:
            a.lookup(make_keys("many", 5000), 1 * MiB)
        assert err.value.code == "too_many_keys"
        with pytest.raises(PoolRequestError) as err:
            a.reserve(b"o" * 16, make_keys("big", 1), 1 << 30)
        assert err.value.code == "bad_page_size"
        a.release([lease.lease_id], wait=True)
    healthy(shared_pool)


_valid = st.sampled_from(
    [
        P.Lookup(keys=make_keys("f", 3), page_bytes=1 * MiB),
        P.Reserve(namespace=b"f" * 16, keys=make_keys("f", 2), page_bytes=1 * MiB),
        P.Commit(reservation_id=2, checksums=[1]),
        P.Release(lease_ids=[1, 2, 3]),
        P.Abort(reservation_id=1),
        P.Drop(keys=make_keys("f", 1)),
        P.GetStats(),
    ]
)


@st.composite
def mutated(draw):
    payload = bytearray(msgspec.msgpack.encode(draw(_valid)))
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, len(payload) - 1))
        payload[pos] = draw(st.integers(0, 255))
    return bytes(payload)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payloads=st.lists(st.one_of(st.binary(max_size=200), mutated()), min_size=1, max_size=8))
def test_fuzz_random_and_mutated_messages(shared_pool, payloads):
    raw = RawClient(shared_pool)
    for payload in payloads:
        raw.send_frame(payload)
        reply = raw.reply()
        if reply is None:
            break  # the daemon may close an offending connection; it must not die
    raw.sock.close()
    healthy(shared_pool)


def test_socket_is_owner_only_and_uid_check(shared_pool):
    assert stat.S_IMODE(os.stat(shared_pool).st_mode) == 0o600
    with running_pool("16MiB", ("--extent-size", "4MiB", "--allow-uid", str(os.getuid() + 4242))) as path:
        with pytest.raises(PoolRequestError) as err:
            PoolClient(path).connect()
        assert err.value.code == "not_allowed"


@pytest.mark.skipif(hugepages_free_bytes() > 0, reason="hugepages are reserved here; the refusal path cannot be shown")
def test_hugepages_without_reservation_is_a_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvshare", "pool", "--size", "64MiB", "--hugepages", "--socket", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "hugepages" in proc.stderr and "reserve" in proc.stderr


@pytest.mark.skipif(hugepages_free_bytes() < 64 * MiB, reason="too few hugepages are reserved on this machine")
@pytest.mark.parametrize("mode", [("--hugepages",), ()], ids=["on", "auto (the default)"])
def test_hugepages_pool_serves(mode):
    with running_pool("64MiB", (*mode, "--extent-size", "16MiB")) as path:
        workers.write_pages(path, "huge", 2, 1 * MiB)
        assert len(workers.read_pages(path, "huge", 2, 1 * MiB)) == 2
        with PoolClient(path).connect() as client:
            assert client.stats()["arena_page_bytes"] == 2 * MiB


def test_hugepages_off_and_too_few_take_os_pages():
    """Off never takes hugepages; a pool larger than the free hugepages (auto) serves on the OS's pages."""
    too_large = f"{(hugepages_free_bytes() // MiB + 64) // 2 * 2}MiB"
    for args in (("--hugepages", "off"), ()):
        with running_pool(too_large if not args else "64MiB", (*args, "--extent-size", "16MiB")) as path:
            with PoolClient(path).connect() as client:
                assert client.stats()["arena_page_bytes"] == mmap.PAGESIZE


def test_metrics_and_pool_stats_cli():
    port = free_port()
    with running_pool("16MiB", ("--extent-size", "4MiB", "--metrics-port", str(port))) as path:
        workers.write_pages(path, "m", 2, 1 * MiB)
        import time

        time.sleep(0.6)  # the metrics thread reads the snapshot taken every tick
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "kvshare_pool_capacity_bytes 1.6777216e+07" in text
        assert "kvshare_pool_committed_pages_total 2.0" in text
        out = subprocess.run(
            [sys.executable, "-m", "kvshare", "pool-stats", "--socket", path],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        import json

        stats = json.loads(out)
        for field in (
            "capacity_bytes",
            "pages_used",
            "pages_free",
            "entries",
            "leases",
            "reservations",
            "evictions",
            "hit_chunks",
            "miss_chunks",
            "skipped_stores",
            "errors",
        ):
            assert field in stats
        assert stats["entries"] == 2
