import socket

import pytest

from kvshare.launch import Cluster, ClusterConfig


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports above it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no block of free ports")


def start_cluster(policy: str = "alternate", replicas: int = 2, **kw) -> Cluster:
    cfg = ClusterConfig(num_replicas=replicas, policy=policy, port=free_port_block(replicas + 1), pool_size="512MiB",
                        ready_timeout_s=120, **kw)
    return Cluster(cfg).start()


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster("alternate")
    yield c
    c.stop()
