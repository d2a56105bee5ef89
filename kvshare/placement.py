"""Where each replica of ``kvshare up`` runs: its device, its share of a GPU, which replicas it starts after, the
interpreter that runs vLLM, and its CPU threads. Pure functions of the cluster's configuration (and, for the
interpreter, of what is installed)."""

from __future__ import annotations

import os
import sys
from typing import Protocol


class ClusterConfig(Protocol):
    """What placement reads of ``kvshare.cluster_config.ClusterConfig``."""

    engine: str
    device: str
    num_replicas: int
    replica_args: tuple[str, ...]


def is_device_name(name: str) -> bool:
    """Whether ``name`` is a device a replica or validate runs on: cpu, cuda or cuda:N."""
    return name == "cpu" or name == "cuda" or (name.startswith("cuda:") and name[len("cuda:") :].isdigit())


def gpu_of_replica(devices: str, index: int) -> tuple[str, str | None]:
    """Replica ``index``'s ``--device`` out of ``kvshare up --device``, and its CUDA_VISIBLE_DEVICES (None: as
    inherited). One device is every replica's; a comma list is cycled over them (``cuda:0,cuda:1``: a GPU
    each, as the study's two replicas ran), and then a replica sees only its own GPU, as ``cuda`` (so that
    its threads, streams and the pool's registration all use that one, as a vLLM replica's would)."""
    names = devices.split(",")
    device = names[index % len(names)]
    if len(names) > 1 and device.startswith("cuda:"):
        return "cuda", device[len("cuda:") :]
    return device, None


VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU for one replica


def gpu_memory_share(cfg: ClusterConfig, index: int) -> float | None:
    """--gpu-memory-utilization of vLLM replica ``index``: vLLM's 0.9 split evenly between the replicas that
    share its GPU (two on one GPU: 0.45 each); None (vLLM's default) when it has a GPU to itself or when
    --replica-arg sets the flag."""
    if any(arg.split("=")[0] == "--gpu-memory-utilization" for arg in cfg.replica_args):
        return None
    mine = gpu_of_replica(cfg.device, index)
    sharing = sum(gpu_of_replica(cfg.device, j) == mine for j in range(cfg.num_replicas))
    return None if sharing == 1 else round(VLLM_GPU_MEMORY_UTILIZATION / sharing, 3)


def starts_after(cfg: ClusterConfig, index: int) -> list[int]:
    """The replicas that must be ready before replica ``index`` starts: for vLLM on a GPU, the earlier ones on
    its GPU. vLLM sizes its KV cache from the memory it sees taken while it profiles, so a neighbour loading its
    weights at the same time shrinks it (two 8B-shape replicas started together on one H200 at 0.45 each: the
    second got 1.54 GiB of KV and refused to start). With --kv-cache-memory-bytes vLLM does not size it so."""
    if cfg.engine != "vllm" or cfg.device == "cpu":
        return []
    from kvshare.integrations.vllm.launch import has_flag

    if has_flag(cfg.replica_args, "--kv-cache-memory-bytes"):
        return []
    mine = gpu_of_replica(cfg.device, index)
    return [j for j in range(index) if gpu_of_replica(cfg.device, j) == mine]


def find_vllm_python() -> str:
    """The interpreter that runs vLLM when --vllm-python is not given: this one when it can import vLLM
    (installed here, or on PYTHONPATH), else the one named by the ``vllm`` command on PATH, else this one
    (the preflight then says what is missing)."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    script = shutil.which("vllm")
    if script is not None:
        try:
            with open(script, "rb") as f:
                first = f.readline().decode(errors="replace").strip()
        except OSError:
            first = ""
        if first.startswith("#!") and os.path.isfile(first[2:].split()[0]):
            return first[2:].split()[0]
    return sys.executable


def cpu_threads_env(cfg: ClusterConfig) -> dict | None:
    """On CPU, split the cores between the replicas (unless OMP_NUM_THREADS is set).

    Each replica's torch would otherwise run one thread per core; with N replicas on the same cores
    the threads of one parallel region wait on descheduled siblings: on a busy 2-core machine a
    200-token prefill took 4.4 s with 2 threads per replica and 0.12 s with 1.
    """
    if cfg.device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // cfg.num_replicas)))
