"""``python -m kvshare.integrations.vllm.bench --copy-only``: the connector's store and load of one prompt on
vLLM-CPU-shaped tensors of the tiny preset, without vLLM (the worker and scheduler driven directly)."""

from __future__ import annotations

import subprocess
import time

from kvshare.integrations.vllm.options import ConnectorConfig

COLD_FLUSH_BYTES = 1 << 30


def copy_bandwidth(num_tokens: int, repeats: int = 3) -> dict:
    """The worker's store and load of one prompt on vLLM-CPU-shaped tensors of the tiny preset (no vLLM),
    with the connector's default settings; loads into an ascending and a descending block table, and
    ("cold") into the ascending one after 1 GiB of other writes pushed the pages out of the caches."""
    import numpy as np
    import torch

    from kvshare.integrations.vllm.layout import PagedLayout
    from kvshare.integrations.vllm.metadata import WorkerReport
    from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
    from kvshare.integrations.vllm.worker import PoolKVWorker
    from kvshare.keys import Namespace
    from kvshare.layout import KVLayout
    from kvshare.pool.link import PoolLink
    from kvshare.pool.spawn import running_pool

    L, H, D, N = 8, 2, 64, 32
    layout = KVLayout(L, H, D, "float32")
    namespace = Namespace("tiny", "0" * 32, "float32", L, H, D, engine_family="vllm")
    num_blocks = num_tokens // N + 8
    size = (num_tokens // layout.chunk_tokens + 4) * layout.page_bytes
    with running_pool(size, ("--prefault",), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as sock:
        sides = []
        defaults = ConnectorConfig(pool_socket=sock)
        for name in ("A", "B"):
            worker = PoolKVWorker(
                layout,
                PoolLink(sock, name + "w"),
                verify_fraction=defaults.verify_fraction,
                copy_threads=defaults.copy_threads,
            )
            worker.register(
                [torch.randn(num_blocks, H, N, 2 * D) for _ in range(L)],
                PagedLayout("cpu_attn", num_blocks, N, H, D, torch.float32),
            )
            sides.append(
                (
                    PoolScheduler(
                        ConnectorConfig(pool_socket=sock), namespace, layout.page_bytes, N, PoolLink(sock, name + "s")
                    ),
                    worker,
                )
            )
        (sa, wa), (sb, wb) = sides
        prompt, blocks = list(range(num_tokens + 1)), list(range(num_blocks))
        sa.add_request("a", prompt, None, None)
        sa.allocated("a", sa.match("a", 0), 0)
        started = time.perf_counter()
        for spec in sa.plan_step([ScheduledRequest("a", 0, num_tokens + 1, blocks)]).stores:
            wa.store(spec)
        store_s = time.perf_counter() - started
        loads: dict[str, list[float]] = {"ascending": [], "descending": [], "cold": []}
        flush = np.empty(COLD_FLUSH_BYTES, dtype=np.uint8)  # larger than the L3 cache of the machines here
        for i in range(repeats):
            for order, table in (("ascending", blocks), ("descending", blocks[::-1]), ("cold", blocks)):
                if order == "cold":  # as in a serving replica: the pages were stored long ago, caches hold other work
                    flush.fill(i + 1)
                req = f"b{i}-{order}"
                sb.add_request(req, prompt, None, None)
                n = sb.match(req, 0)
                sb.allocated(req, n, 0)
                plan = sb.plan_step([ScheduledRequest(req, n, num_tokens + 1 - n, table)])
                started = time.perf_counter()
                outcome = wb.load(plan.loads[0])
                loads[order].append(time.perf_counter() - started)
                sb.on_report(WorkerReport([outcome]))
                sb.finish(req)
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
