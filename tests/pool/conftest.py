import hashlib
import os
import socket

import pytest

from kvshare.pool.spawn import running_pool

MiB = 1 << 20


def make_keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pool():
    """A fresh 64 MiB pool (extent 16 MiB) that keeps everything committed (no watermark eviction)."""
    with running_pool("64MiB", ("--extent-size", "16MiB", "--high-watermark", "1", "--low-watermark", "1")) as path:
        yield path


@pytest.fixture(scope="module")
def shared_pool():
    with running_pool("64MiB", ("--extent-size", "16MiB")) as path:
        yield path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
