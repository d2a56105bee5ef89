"""The service level as the command runs it: against ``--replica`` URLs, or a cluster it starts itself.

Without replicas it starts ``kvshare up`` in-process (kvshare.launch.Cluster: a pool,
``--service-replicas`` replicas of ``--model`` on the validate device, a router) on
free ports, runs the level against the replicas directly, and stops everything.
"""

from __future__ import annotations

from kvshare.launch import free_port_block
from kvshare.validate.report import LevelResult
from kvshare.validate.service import ServiceConfig, run_service_level


def service_config(config, replicas: tuple[str, ...]) -> ServiceConfig:
    return ServiceConfig(
        replicas=replicas,
        max_tokens=config.max_tokens,
        completion_lengths=config.prompt_lengths,
        num_chat=config.num_chat,
        chunk_tokens=config.chunk_tokens,
        gap_threshold=config.gap_threshold,
        timeout_s=config.request_timeout_s,
        seed=config.seed,
        grid_tokens=None if config.replicas else grid_of_args(config.replica_args),
    )


def grid_of_args(replica_args: tuple[str, ...]) -> int | None:
    """``--grid-tokens N`` (or ``=N``) among the arguments of the replicas validate starts; None: not given."""
    value = None
    for i, arg in enumerate(replica_args):
        if arg == "--grid-tokens" and i + 1 < len(replica_args):
            value = replica_args[i + 1]
        elif arg.startswith("--grid-tokens="):
            value = arg.split("=", 1)[1]
    return int(value) if value is not None else None


def run_service(config, device: str, console=None, after_prime=None) -> LevelResult:
    if config.replicas:
        return run_service_level(service_config(config, tuple(config.replicas)), after_prime)
    from kvshare.launch import Cluster, ClusterConfig

    cluster_config = ClusterConfig(
        num_replicas=config.num_replicas,
        model=config.model,
        device=device,
        pool_size=config.service_pool_size,
        port=free_port_block(config.num_replicas + 1),
        replica_args=("--chunk-tokens", str(config.chunk_tokens), *config.replica_args),
        ready_timeout_s=600.0,
    )
    cluster = Cluster(cluster_config)
    if console is not None:
        console.print(f"starting {config.num_replicas} replicas of {config.model} on {device} (kvshare up) ...")
    cluster.start()
    try:
        result = run_service_level(service_config(config, tuple(cluster.replica_urls)), after_prime)
    finally:
        cluster.stop()
    result.figures["cluster"] = {
        "model": config.model,
        "device": device,
        "replicas": cluster_config.num_replicas,
        "pool_size": config.service_pool_size,
        "replica_args": list(config.replica_args),
    }
    return result
