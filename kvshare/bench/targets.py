"""Where experiments send requests: given URLs, or a cluster the harness starts and stops itself.

- ``--replica URL ...``: servers already running (kvshare replicas or vLLM servers).
- ``--model M``: a ``kvshare.launch.Cluster`` (pool, N replicas, router) on free ports.
- ``--model M --sequential``: one pool, replicas started one at a time (``SequentialReplicas``),
  for a model that fits the device only once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from kvshare.bench.replicas import FixedReplicas, SequentialConfig, SequentialReplicas
from kvshare.launch import free_port_block


@dataclass(frozen=True)
class TargetSpec:
    replica_urls: tuple[str, ...] = ()
    off_replica_urls: tuple[str, ...] = ()  # pool OFF requests go here (a cluster without a pool)
    model: str | None = None  # start replicas of this model (directory or preset) instead
    device: str = "cpu"
    num_replicas: int = 2
    pool_size: str = "4GiB"
    pool_args: tuple[str, ...] = ()
    replica_args: tuple[str, ...] = ()
    is_sequential: bool = False
    port: int | None = None  # first port of the started processes (default: a free block)
    log_dir: str | None = None
    use_extension: bool = True  # the servers take kvshare's request extension

    def __post_init__(self) -> None:
        if bool(self.replica_urls) == bool(self.model):
            raise ValueError("give either --replica URLs of running servers or --model to start replicas")
        if self.is_sequential and not self.model:
            raise ValueError("--sequential starts replicas itself: give --model")
        if self.num_replicas < 2 and self.model:
            raise ValueError("cross-replica experiments need at least 2 replicas")


@contextlib.contextmanager
def open_target(spec: TargetSpec, progress=None) -> Iterator[tuple[object, object | None]]:
    """(replicas, off_replicas or None), started if needed, stopped on exit."""
    off = FixedReplicas(list(spec.off_replica_urls), use_extension=False) if spec.off_replica_urls else None
    if spec.replica_urls:
        yield FixedReplicas(list(spec.replica_urls), use_extension=spec.use_extension), off
        return
    if spec.is_sequential:
        replicas = SequentialReplicas(
            SequentialConfig(
                model=spec.model,
                device=spec.device,
                num_replicas=spec.num_replicas,
                pool_size=spec.pool_size,
                pool_args=spec.pool_args,
                replica_args=spec.replica_args,
                port=spec.port or free_port_block(spec.num_replicas),
                log_dir=spec.log_dir,
            )
        )
        try:
            replicas.start()
            yield replicas, off
        finally:
            replicas.close()
        return
    from kvshare.launch import Cluster, ClusterConfig

    cluster = Cluster(
        ClusterConfig(
            num_replicas=spec.num_replicas,
            model=spec.model,
            device=spec.device,
            pool_size=spec.pool_size,
            pool_args=spec.pool_args,
            replica_args=spec.replica_args,
            port=spec.port or free_port_block(spec.num_replicas + 1),
            log_level="WARNING",
        )
    )
    try:
        cluster.start(progress=progress)
        yield FixedReplicas(cluster.replica_urls), off
    finally:
        cluster.stop()
