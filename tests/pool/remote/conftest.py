"""Fixtures of the remote suite: Redis servers and a cluster on loopback ports, pools that use them."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid

import numpy as np
import pytest

from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool

MiB = 1 << 20
NAMESPACE = hashlib.blake2b(b"remote-tests", digest_size=16).digest()
HAS_REDIS = shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None
NO_REDIS = "redis-server/redis-cli not installed (apt-get install redis-server; scripts/test does it)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port P <= 55535 whose cluster bus port P + 10000 is free too (Redis refuses higher ports)."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class RedisServer:
    """One redis-server child on a loopback port, without persistence; can be killed, stopped and restarted."""

    def __init__(self, port: int | None = None, cluster: bool = False, workdir: str | None = None) -> None:
        self.port = port or (free_cluster_port() if cluster else free_port())
        self.cluster = cluster
        self.is_own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvshare-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        """Start (or restart, on the same port) and wait until it answers; a server that does not is killed."""
        cmd = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.workdir,
            "--logfile",
            os.path.join(self.workdir, f"{self.port}.log"),
        ]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_until(lambda: self.cli("ping") == "PONG", 10):
            self.kill()
            raise RuntimeError(f"redis-server on port {self.port} did not start (see {self.workdir})")
        return self

    def cli(self, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, timeout=10)
        return out.stdout.strip()

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
            self.proc = None
        if self.is_own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def redis_server():
    if not HAS_REDIS:
        pytest.skip(NO_REDIS)
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_cluster():
    """Three primaries on loopback ports; yields (url, [servers])."""
    if not HAS_REDIS:
        pytest.skip(NO_REDIS)
    workdir = tempfile.mkdtemp(prefix="kvshare-cluster-")
    servers = []
    try:
        for _ in range(3):
            servers.append(RedisServer(cluster=True, workdir=workdir))
            servers[-1].start()
        nodes = [f"127.0.0.1:{s.port}" for s in servers]
        out = subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-yes"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert wait_until(lambda: all("cluster_state:ok" in s.cli("cluster", "info") for s in servers), 30)
        yield "redis+cluster://" + ",".join(nodes), servers
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def prefix() -> str:
    """A key prefix of its own for each test, so tests sharing a store never see each other's pages."""
    return f"t{uuid.uuid4().hex[:12]}"


def pool_args(url: str, prefix: str, *extra: str) -> tuple[str, ...]:
    return (
        "--extent-size",
        "16MiB",
        "--high-watermark",
        "1",
        "--low-watermark",
        "1",
        "--remote",
        url,
        "--remote-prefix",
        prefix,
        "--remote-part-size",
        "256KiB",
        "--remote-timeout",
        "0.5",
        "--remote-breaker-reset",
        "1",
        "--remote-promote-timeout",
        "3",
        *extra,
    )


@contextlib.contextmanager
def two_pools(url: str, prefix: str, *extra: str, size: str = "64MiB"):
    """Pools A and B (separate arenas: two hosts) sharing one remote store; yields their sockets."""
    args = pool_args(url, prefix, *extra)
    with running_pool(size, args, quiet=True) as a, running_pool(size, args, quiet=True) as b:
        yield a, b


def make_keys(tag: str, n: int) -> list[bytes]:
    """A chain of n chunk keys, unique per tag (like kvshare.keys.chunk_keys)."""
    keys, previous = [], NAMESPACE
    for i in range(n):
        previous = hashlib.blake2b(previous + f"{tag}/{i}".encode(), digest_size=16).digest()
        keys.append(previous)
    return keys


def page_data(tag: str, i: int, page_bytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, page_bytes, dtype=np.uint8)


def write_chain(
    client: PoolClient, keys: list[bytes], page_bytes: int, tag: str, namespace: bytes = NAMESPACE, first_depth: int = 0
) -> list[np.ndarray]:
    """Reserve, fill and commit a page for every key; returns the bytes written."""
    data = [page_data(tag, first_depth + i, page_bytes) for i in range(len(keys))]
    reservation = client.reserve(namespace, keys, page_bytes, first_depth)
    assert len(reservation.grants) == len(keys), reservation
    sums = []
    for i, offset in reservation.grants:
        view = client.page(offset, page_bytes)
        view[:] = data[i]
        sums.append(page_checksum(view))
    client.commit(reservation.reservation_id, sums)
    return data


def remote_stats(client: PoolClient) -> dict:
    return client.stats()["remote"]


def wait_written(client: PoolClient, num_pages: int, timeout: float = 20.0) -> dict:
    """Wait until the pool's write-behind has written (or found in the store) ``num_pages`` pages in all."""
    assert wait_until(lambda: _done(remote_stats(client)) >= num_pages, timeout), remote_stats(client)
    return remote_stats(client)


def _done(stats: dict) -> int:
    return stats["written_pages"] + stats["write_existing"]


def assert_pages_equal(client: PoolClient, pages, expected: list[np.ndarray]) -> None:
    assert len(pages) == len(expected)
    for header, data in zip(pages, expected):
        assert np.array_equal(client.page(header.offset, header.page_bytes), data)
        assert page_checksum(data) == header.checksum
