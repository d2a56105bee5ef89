"""A vLLM-shaped replica for the GPU path's tests: scheduler side, worker side and the hooks, driven in vLLM's order.

Used on CPU tensors under the fake CUDA (test_staged.py) and on a real GPU (test_cuda.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvshare.integrations.vllm.cpu import CpuKVWorker
from kvshare.integrations.vllm.gpu import GpuKVWorker
from kvshare.integrations.vllm.layout import as_bits, reference_gather
from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.integrations.vllm.paged_tensors import fill_random_, paged_layers
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.integrations.vllm.worker import WorkerHooks
from kvshare.keys import Namespace
from kvshare.layout import KVLayout
from kvshare.pool.link import PoolLink


def namespace_of(layout: KVLayout, model: str = "staged-test") -> Namespace:
    return Namespace(
        model,
        "f" * 32,
        layout.dtype,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        chunk_tokens=layout.chunk_tokens,
        engine_family="vllm",
    )


class Replica:
    """One replica's connector sides over vLLM-shaped KV tensors of memory order ``order``."""

    def __init__(
        self,
        socket_path: str,
        name: str,
        layout: KVLayout,
        order: str,
        num_blocks: int,
        block_size: int,
        device,
        staged: bool | None = None,
        worker_kwargs: dict | None = None,
        **config,
    ) -> None:
        self.layout, self.block_size = layout, block_size
        self.config = ConnectorConfig(pool_socket=socket_path, chunk_tokens=layout.chunk_tokens, replica=name, **config)
        self.scheduler = PoolScheduler(
            self.config, namespace_of(layout), layout.page_bytes, block_size, PoolLink(socket_path, f"{name}-s")
        )
        dtype = getattr(torch, layout.dtype)
        self.layers, self.paged = paged_layers(
            order, layout.num_layers, num_blocks, block_size, layout.num_kv_heads, layout.head_dim, dtype, device
        )
        link = PoolLink(socket_path, f"{name}-w")
        if staged if staged is not None else torch.device(device).type == "cuda":  # GPU staging (a fake CUDA on CPU)
            self.worker = GpuKVWorker(layout, link, self.config.verify_fraction, **(worker_kwargs or {}))
        else:  # the GPU path's copy settings (``transfer``) mean nothing on CPU
            cpu_kwargs = {key: value for key, value in (worker_kwargs or {}).items() if key != "transfer"}
            self.worker = CpuKVWorker(
                layout, link, self.config.verify_fraction, overlap_load=self.config.overlap_load, **cpu_kwargs
            )
        self.worker.register(self.layers, self.paged)
        self.hooks = WorkerHooks(self.worker, block_size)
        self.last_errors: set[int] = set()

    def fill(self, seed: int) -> None:
        for index, layer in enumerate(self.layers):
            fill_random_(layer, seed * 1000 + index)

    def step(
        self,
        req_id: str,
        prompt: list[int],
        block_ids: list[int],
        write_layer=None,
        wait_layers: bool = True,
        save_layers: bool = True,
        no_layer_hooks: bool = False,
    ):
        """One prefill step of the whole prompt in vLLM's hook order; returns the load outcome (or None).
        ``no_layer_hooks``: the plan says the forward may run as one full CUDA graph (no per-layer hooks)."""
        s = self.scheduler
        s.add_request(req_id, prompt, None, None)
        external = s.match(req_id, 0)
        s.allocated(req_id, external, 0)
        plan = s.plan_step([ScheduledRequest(req_id, 0 + external, len(prompt) - external, block_ids)])
        plan = replace(plan, no_layer_hooks=no_layer_hooks)
        h = self.hooks
        h.start_load(plan)
        for index in range(self.layout.num_layers):
            if wait_layers:
                h.wait_layer(index)
            if write_layer is not None:
                write_layer(index)  # the "attention layer": its kernels write (or read) layer index
            if save_layers:
                h.save_layer(index, plan)
        h.wait_for_save(plan)
        self.last_errors = h.load_errors()
        outcomes = h.take_outcomes()
        s.on_report(WorkerReport(outcomes))
        s.finish(req_id)
        return outcomes[0] if outcomes else None

    def tokens(self, start: int, num: int, block_ids: list[int]) -> torch.Tensor:
        """K and V of prompt tokens ``start ..`` in every layer as integers (bits: NaN compares equal),
        ``[L, 2, T, H, D]``, read by the slow reference."""
        return as_bits(
            torch.stack([reference_gather(layer.cpu(), self.paged, start, num, block_ids) for layer in self.layers])
        )

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()
