"""The CPU cores of vLLM CPU replicas: how many vLLM keeps off its OpenMP threads with kvshare's connector, and
each tensor-parallel rank's share of the cores (VLLM_CPU_OMP_THREADS_BIND).

Pure but for ``advise_on_cpu_cores``, which the connector calls at start inside vLLM (it imports vLLM there).
"""

from __future__ import annotations

import logging
import os

RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"  # vLLM CPU: cores kept off the OpenMP threads


def connector_reserved_cpus(tensor_parallel_size: int) -> int:
    """VLLM_CPU_NUM_OF_RESERVED_CPU of a CPU replica with kvshare's connector: the cores vLLM keeps off its
    OpenMP threads without a connector, one per rank (for its scheduler and API processes).

    Given any KV connector, vLLM 0.32 keeps one more core per rank (meant for NIXL's transfers). kvshare's
    connector needs none: its copies run inside the step. With that core a replica with the connector runs
    other OpenMP threads than plain vLLM: on 2 cores the reservation covers every core, which vLLM then
    ignores, and the replica ran 2 threads on cores other processes share, decoding several times slower than
    plain vLLM with 1 beside it (docs/vllm.md, "CPU cores"). With this value both get the same cores."""
    return tensor_parallel_size


def reserved_cpus_advice(env: dict[str, str], tensor_parallel_size: int) -> str | None:
    """What to set where vLLM CPU, started with the connector, keeps its extra core (None: nothing to set): with
    VLLM_CPU_NUM_OF_RESERVED_CPU unset and vLLM's automatic binding, vLLM keeps one more core per rank off its
    OpenMP threads than without the connector (``connector_reserved_cpus``)."""
    if env.get(RESERVED_CPUS_ENV) or env.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None
    return (
        f"set {RESERVED_CPUS_ENV}={connector_reserved_cpus(tensor_parallel_size)} to give vLLM's OpenMP threads "
        "the cores plain vLLM gets: vLLM keeps one more core per rank off them for a KV connector, and "
        'kvshare\'s needs none (docs/vllm.md, "CPU cores")'
    )


def advise_on_cpu_cores(tensor_parallel_size: int) -> None:
    """On vLLM CPU, a warning at the connector's start where vLLM keeps a core off its OpenMP threads for it."""
    from vllm.platforms import current_platform

    advice = reserved_cpus_advice(dict(os.environ), tensor_parallel_size)
    if current_platform.device_type == "cpu" and advice is not None:
        logging.getLogger("kvshare.integrations").warning("kvshare: %s", advice)


def rank_core_binds(cores: list[int], num_ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``num_ranks`` CPU ranks: the cores cut into equal consecutive shares,
    one per rank ("0|1", "0,1|2,3"); refuses fewer cores than ranks."""
    if len(cores) < num_ranks:
        raise ValueError(
            f"{num_ranks} tensor parallel ranks on CPU need at least {num_ranks} cores, "
            f"this process may use {len(cores)}"
        )
    share = len(cores) // num_ranks
    return "|".join(",".join(map(str, cores[r * share : (r + 1) * share])) for r in range(num_ranks))
