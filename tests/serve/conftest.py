import pytest

from kvshare.launch import Cluster, ClusterConfig, free_port_block


def start_cluster(policy: str = "alternate", replicas: int = 2, **kw) -> Cluster:
    cfg = ClusterConfig(
        num_replicas=replicas,
        policy=policy,
        port=free_port_block(replicas + 1),
        pool_size="512MiB",
        ready_timeout_s=120,
        **kw,
    )
    return Cluster(cfg).start()


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster("alternate")
    yield c
    c.stop()
