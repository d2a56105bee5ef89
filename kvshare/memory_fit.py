"""Whether ``kvshare up``'s built-in replicas and pool fit the machine's memory and the GPUs', before they start.

A built-in replica holds, estimated from the model's configuration without loading it::

    weights      every parameter in the dtype it runs (a directory: its safetensors files' bytes; a preset: its
                 parameters, kvshare.engine.preset_table), at start-up
    KV           the sequence KV of a whole context (--max-model-len, else the model's): on CUDA allocated at
                 start-up; on CPU as the longest request needs it
    local cache  --local-cache-size (1 GiB), on the replica's device, as prompts fill it
    runtime      the interpreter, torch and the server: ~0.35 GiB RSS for the tiny model, counted as 0.5 GiB; on
                 a GPU also its CUDA context and staging buffers, counted as 1 GiB

On the host: the CPU replicas' weights and runtime are taken at start-up, and more than the memory this process
may use is refused (the kernel's OOM killer would end a replica, or any other process); what requests may fill
later (the KV of a whole context, the local caches, the pool) is added for a warning with the numbers. On each
GPU (sizes from nvidia-smi, so this process opens no CUDA context): the weights, the KV and the runtime of the
replicas placed on it are taken at start-up and refused past its memory; the local caches warn. vLLM replicas
size their KV to the memory they find and are not estimated here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

from kvshare.cluster_config import ClusterConfig, flag_value
from kvshare.errors import UserError
from kvshare.layout import DTYPE_ITEMSIZE
from kvshare.units import format_bytes, parse_count, parse_size_or_off

log = logging.getLogger(__name__)

HOST_RUNTIME_BYTES = 1 << 29  # per replica process: interpreter, torch, server (0.35 GiB RSS measured, tiny)
GPU_RUNTIME_BYTES = 1 << 30  # per replica on a GPU: CUDA context, two 256 MiB staging buffers, decode graphs
DEFAULT_LOCAL_CACHE = "1GiB"  # kvshare serve --local-cache-size's default
_DTYPES = {"half": "float16", "float": "float32"}  # vLLM's --dtype names that are not torch's


@dataclass(frozen=True)
class ReplicaMemory:
    """What one built-in replica holds, in bytes; ``context``: the tokens its KV is sized for."""

    weights: int
    kv: int
    local_cache: int
    context: int
    device: str

    @property
    def runtime(self) -> int:
        return GPU_RUNTIME_BYTES if self.device.startswith("cuda") else HOST_RUNTIME_BYTES

    @property
    def at_start(self) -> int:
        """Taken as it starts: weights and runtime, and on CUDA the KV of its whole context."""
        return self.weights + self.runtime + (self.kv if self.device.startswith("cuda") else 0)

    @property
    def at_most(self) -> int:
        return self.weights + self.runtime + self.kv + self.local_cache

    def describe(self) -> str:
        return (
            f"{format_bytes(self.weights)} of weights + {format_bytes(self.kv)} of KV for a {self.context}-token "
            f"context + {format_bytes(self.local_cache)} local cache + {format_bytes(self.runtime)} runtime"
        )


def replica_memory(model: str, replica_args: tuple[str, ...], device: str) -> ReplicaMemory:
    """One built-in replica's memory for ``model`` (a checked directory or preset) with ``replica_args``."""
    from kvshare.engine.config import KV_DTYPES
    from kvshare.engine.preset_table import PRESETS
    from kvshare.preflight import model_layout

    native = model_layout(model, 1)
    dtype = flag_value(replica_args, "--dtype") or "auto"
    dtype = native.dtype if dtype == "auto" else _DTYPES.get(dtype, dtype)
    kv_dtype = flag_value(replica_args, "--kv-dtype") or "auto"
    kv_dtype = dtype if kv_dtype == "auto" else KV_DTYPES[kv_dtype]
    if os.path.isdir(model):
        # the files hold the config's dtype (the layout's); the replica converts them to its own
        weights = _directory_weights(model) * DTYPE_ITEMSIZE[dtype] // native.itemsize
        context = _directory_context(model)
    else:
        preset = PRESETS[model]
        weights = preset.num_parameters * DTYPE_ITEMSIZE[dtype]
        context = preset.config.max_position_embeddings
    max_model_len = flag_value(replica_args, "--max-model-len")
    if max_model_len not in (None, "auto", "-1"):
        context = parse_count(max_model_len)
    kv_per_token = native.bytes_per_token * DTYPE_ITEMSIZE[kv_dtype] // native.itemsize
    local_cache = parse_size_or_off(flag_value(replica_args, "--local-cache-size") or DEFAULT_LOCAL_CACHE)
    return ReplicaMemory(weights, kv_per_token * context, local_cache, context, device)


def _directory_weights(model: str) -> int:
    names = [n for n in os.listdir(model) if n.endswith(".safetensors")]
    return sum(os.path.getsize(os.path.join(model, n)) for n in names)


def _directory_context(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f).get("max_position_embeddings", 4096))


def check_cluster_fits(cfg: ClusterConfig, pool_bytes: int) -> None:
    """Refuse (UserError) built-in replicas whose start-up memory exceeds the host's or a GPU's; warn, with the
    numbers, where what requests may fill later (the KV of a whole context, local caches, the pool) would."""
    if cfg.engine != "builtin":
        return
    from kvshare.placement import gpu_of_replica

    placed: dict[tuple[str, str | None], list[ReplicaMemory]] = {}
    for i in range(cfg.num_replicas):
        device, visible = gpu_of_replica(cfg.device, i)
        try:
            memory = replica_memory(cfg.model, cfg.replica_args, device)
        except (KeyError, ValueError) as exc:  # a --replica-arg value the replica itself will refuse, by name
            log.debug("no memory estimate for the replicas (%s)", exc)
            return
        placed.setdefault((device, visible), []).append(memory)
    _check_host(cfg.model, [m for group in placed.values() for m in group], pool_bytes)
    totals = _gpu_totals()
    for (device, visible), replicas in placed.items():
        gpu = _physical_gpu(device, visible)
        if device != "cpu" and gpu is not None and gpu in totals:
            _check_gpu(cfg.model, f"GPU {gpu}", replicas, totals[gpu])


def _check_host(model: str, replicas: list[ReplicaMemory], pool_bytes: int) -> None:
    from kvshare.preflight import meminfo, memory_limit

    on_cpu = [m for m in replicas if m.device == "cpu"]
    at_start = sum(m.at_start for m in on_cpu) + HOST_RUNTIME_BYTES * (len(replicas) - len(on_cpu))
    at_most = sum(m.at_most for m in on_cpu) + HOST_RUNTIME_BYTES * (len(replicas) - len(on_cpu)) + pool_bytes
    limit, what = memory_limit()
    if at_start > limit and on_cpu:
        raise UserError(
            f"{len(on_cpu)} replica(s) of {model} on CPU need about {format_bytes(at_start)} as they start (each "
            f"{format_bytes(on_cpu[0].weights)} of weights + {format_bytes(HOST_RUNTIME_BYTES)} runtime), more than "
            f"{what}, {format_bytes(limit)}: the kernel's OOM killer would end one. Run fewer replicas "
            f"(--replicas), a smaller model, or on a GPU (--device cuda)"
        )
    available = meminfo("MemAvailable")
    if at_most > limit or at_start > available:
        bound, against = (limit, what) if at_most > limit else (available, "the memory available now")
        each = f"; each CPU replica up to {on_cpu[0].describe()}" if on_cpu else ""
        log.warning(
            "the cluster may come to hold %s of this machine's memory (%d replica(s) of %s%s; the pool %s), more "
            "than %s, %s: once requests fill it, the kernel's OOM killer may end a replica. Bound it with "
            "--replica-arg=--max-model-len=N, --replica-arg=--local-cache-size=SIZE or --pool-size",
            format_bytes(at_most),
            len(replicas),
            model,
            each,
            format_bytes(pool_bytes),
            against,
            format_bytes(bound),
        )


def _check_gpu(model: str, gpu: str, replicas: list[ReplicaMemory], total: int) -> None:
    at_start, at_most = sum(m.at_start for m in replicas), sum(m.at_most for m in replicas)
    if at_start > total:
        raise UserError(
            f"{len(replicas)} replica(s) of {model} on {gpu} need about {format_bytes(at_start)} of its memory as "
            f"they start (each {replicas[0].describe()}, the KV and runtime allocated at start-up), more than its "
            f"{format_bytes(total)}: give each a smaller context (--replica-arg=--max-model-len=N), a GPU each "
            f"(--device cuda:0,cuda:1), or fewer replicas"
        )
    if at_most > total:
        log.warning(
            "%d replica(s) of %s on %s may come to hold %s of its memory (each %s), more than its %s: the local "
            "caches cap themselves when the GPU runs out (--replica-arg=--local-cache-size=SIZE bounds them)",
            len(replicas),
            model,
            gpu,
            format_bytes(at_most),
            replicas[0].describe(),
            format_bytes(total),
        )


def _physical_gpu(device: str, visible: str | None) -> int | None:
    """The nvidia-smi index of a replica's GPU (``cuda`` or ``cuda:N`` among CUDA_VISIBLE_DEVICES); None unknown."""
    if device == "cpu":
        return None
    index = int(device[len("cuda:") :]) if device.startswith("cuda:") else 0
    listed = visible if visible is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return index
    names = [name.strip() for name in listed.split(",") if name.strip()]
    return int(names[index]) if index < len(names) and names[index].isdigit() else None


def _gpu_totals() -> dict[int, int]:
    """Each GPU's memory in bytes by nvidia-smi index ({} without nvidia-smi): no CUDA context in this process."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    totals = {}
    for line in out.splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().isdigit():
            totals[int(index)] = int(mib) << 20
    return totals


def oom_kills() -> int | None:
    """Processes the kernel's OOM killer has ended since boot (/proc/vmstat oom_kill); None where unknown."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def oom_hint(returncode: int, oom_kills_before: int | None) -> str:
    """ ", the kernel's OOM killer ..." with the memory now, for a child killed by SIGKILL while the OOM killer
    ended a process (its count went up since ``oom_kills_before``); "" otherwise."""
    now = oom_kills()
    if returncode != -signal.SIGKILL or oom_kills_before is None or now is None or now <= oom_kills_before:
        return ""
    from kvshare.preflight import meminfo, memory_limit

    limit, what = memory_limit()
    return (
        f", by the kernel's OOM killer ({now - oom_kills_before} kill(s) meanwhile, /proc/vmstat oom_kill): "
        f"memory ran out; {format_bytes(meminfo('MemAvailable'))} available now of {what}, {format_bytes(limit)}"
    )
