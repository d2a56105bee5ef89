"""``python -m kvshare.integrations.vllm.bench --copy-only``: the connector's store and load of one prompt on
vLLM-CPU-shaped tensors of the tiny preset, without vLLM (the worker and scheduler driven directly)."""

from __future__ import annotations

import subprocess
import time

from kvshare.integrations.vllm.options import ConnectorConfig

COLD_FLUSH_BYTES = 1 << 30
L, H, D, N = 8, 2, 64, 32  # the tiny preset's KV: layers, KV heads, head dim; vLLM's block size on CPU


def copy_bandwidth(num_tokens: int, repeats: int = 3) -> dict:
    """The worker's store and load of one prompt on vLLM-CPU-shaped tensors of the tiny preset (no vLLM),
    with the connector's default settings; loads into an ascending and a descending block table, and
    ("cold") into the ascending one after 1 GiB of other writes pushed the pages out of the caches."""
    from kvshare.layout import KVLayout
    from kvshare.pool.spawn import running_pool

    layout = KVLayout(L, H, D, "float32")
    num_blocks = num_tokens // N + 8
    size = (num_tokens // layout.chunk_tokens + 4) * layout.page_bytes
    with running_pool(size, ("--prefault",), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as sock:
        (sa, wa), (sb, wb) = (_replica(sock, name, layout, num_blocks) for name in ("A", "B"))
        prompt, blocks = list(range(num_tokens + 1)), list(range(num_blocks))
        store_s = _store(sa, wa, prompt, blocks)
        loads = _loads(sb, wb, prompt, blocks, repeats)
        for worker in (wa, wb):
            worker.close()
    num_bytes = num_tokens * layout.bytes_per_token
    best = {order: min(times) for order, times in loads.items()}
    return {
        "tokens": num_tokens,
        "bytes": num_bytes,
        "store_s": store_s,
        "store_GBps": num_bytes / store_s / 1e9,
        **{f"load_{order}_s": t for order, t in best.items()},
        **{f"load_{order}_GBps": num_bytes / t / 1e9 for order, t in best.items()},
    }


def _replica(sock: str, name: str, layout, num_blocks: int):
    """One replica's scheduler side and CPU worker (over random KV tensors), with the connector's defaults."""
    import torch

    from kvshare.integrations.vllm.cpu import CpuKVWorker
    from kvshare.integrations.vllm.layout import PagedLayout
    from kvshare.integrations.vllm.scheduler import PoolScheduler
    from kvshare.keys import Namespace
    from kvshare.pool.link import PoolLink

    defaults = ConnectorConfig(pool_socket=sock)
    worker = CpuKVWorker(
        layout, PoolLink(sock, name + "w"), verify_fraction=defaults.verify_fraction, copy_threads=defaults.copy_threads
    )
    worker.register(
        [torch.randn(num_blocks, H, N, 2 * D) for _ in range(L)],
        PagedLayout("cpu_attn", num_blocks, N, H, D, torch.float32),
    )
    namespace = Namespace("tiny", "0" * 32, "float32", L, H, D, engine_family="vllm")
    return PoolScheduler(defaults, namespace, layout.page_bytes, N, PoolLink(sock, name + "s")), worker


def _store(scheduler, worker, prompt: list[int], blocks: list[int]) -> float:
    """Seconds to store the prompt's chunks from replica A."""
    from kvshare.integrations.vllm.scheduler import ScheduledRequest

    scheduler.add_request("a", prompt, None, None)
    scheduler.allocated("a", scheduler.match("a", 0), 0)
    started = time.perf_counter()
    for spec in scheduler.plan_step([ScheduledRequest("a", 0, len(prompt), blocks)]).stores:
        worker.store(spec)
    return time.perf_counter() - started


def _loads(scheduler, worker, prompt: list[int], blocks: list[int], repeats: int) -> dict[str, list[float]]:
    """Seconds of each of replica B's loads of the prompt, per block order."""
    import numpy as np

    from kvshare.integrations.vllm.metadata import WorkerReport
    from kvshare.integrations.vllm.scheduler import ScheduledRequest

    loads: dict[str, list[float]] = {"ascending": [], "descending": [], "cold": []}
    flush = np.empty(COLD_FLUSH_BYTES, dtype=np.uint8)  # larger than the L3 cache of the machines here
    for i in range(repeats):
        for order, table in (("ascending", blocks), ("descending", blocks[::-1]), ("cold", blocks)):
            if order == "cold":  # as in a serving replica: the pages were stored long ago, caches hold other work
                flush.fill(i + 1)
            req = f"b{i}-{order}"
            scheduler.add_request(req, prompt, None, None)
            n = scheduler.match(req, 0)
            scheduler.allocated(req, n, 0)
            plan = scheduler.plan_step([ScheduledRequest(req, n, len(prompt) - n, table)])
            started = time.perf_counter()
            outcome = worker.load(plan.loads[0])
            loads[order].append(time.perf_counter() - started)
            scheduler.on_report(WorkerReport([outcome]))
            scheduler.finish(req)
    return loads
