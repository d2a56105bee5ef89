"""A tensor parallel replica for the GPU path's tests: one scheduler side (tp_size T), T staged worker ranks.

Each rank's vLLM-shaped tensors hold its heads (kvshare.integrations.vllm.tensor_parallel.head_slice)
of one full-head KV, as vLLM's ranks hold theirs; ranks sharing a replicated head hold the same bytes.
Used on CPU tensors under the fake CUDA (test_staged_tp.py) and on a real GPU (test_cuda_tp.py), beside
staged_replica.Replica (TP=1).
"""

from __future__ import annotations

import torch

from kvshare.integrations.vllm.gpu import GpuKVWorker
from kvshare.integrations.vllm.layout import as_bits, reference_gather
from kvshare.integrations.vllm.metadata import StepPlan, WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.integrations.vllm.paged_tensors import fill_random_, paged_layers
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.integrations.vllm.tensor_parallel import head_slice
from kvshare.integrations.vllm.worker import WorkerHooks
from kvshare.layout import KVLayout
from kvshare.pool.link import PoolLink
from tests.integrations.vllm.staged_replica import namespace_of


class StagedTPReplica:
    """A TP=``tp`` replica over tensors of memory order ``order`` on ``device``, every rank staged."""

    def __init__(
        self,
        socket_path: str,
        name: str,
        layout: KVLayout,
        order: str,
        num_blocks: int,
        block_size: int,
        device,
        tp: int,
        seed: int,
        transfer=None,
    ) -> None:
        self.layout, self.block_size = layout, block_size
        config = ConnectorConfig(pool_socket=socket_path, chunk_tokens=layout.chunk_tokens, replica=name)
        self.scheduler = PoolScheduler(
            config, namespace_of(layout), layout.page_bytes, block_size, PoolLink(socket_path, f"{name}-s"), tp_size=tp
        )
        dtype = getattr(torch, layout.dtype)
        # the full-head KV the ranks shard: [L] of [2, B, N, H, D] integer views
        full, full_paged = paged_layers(
            order, layout.num_layers, num_blocks, block_size, layout.num_kv_heads, layout.head_dim, dtype, device
        )
        for index, layer in enumerate(full):
            fill_random_(layer, seed * 1000 + index)
        self.full = [full_paged.kv_blocks(as_bits(layer)) for layer in full]
        self.ranks: list[WorkerHooks] = []
        for rank in range(tp):
            heads = head_slice(layout.num_kv_heads, rank, tp)
            layers, paged = paged_layers(
                order, layout.num_layers, num_blocks, block_size, heads.num_heads, layout.head_dim, dtype, device
            )
            worker = GpuKVWorker(
                layout,
                PoolLink(socket_path, f"{name}-w{rank}"),
                heads=heads,
                **({"transfer": transfer} if transfer is not None else {}),
            )
            worker.register(layers, paged)
            self.ranks.append(WorkerHooks(worker, block_size))
            for index in range(layout.num_layers):
                self.write_heads(rank, index)

    def write_heads(self, rank: int, index: int) -> None:
        """Rank ``rank``'s heads of the full-head KV into its layer ``index`` (on the current stream)."""
        worker = self.ranks[rank].worker
        worker.paged.kv_blocks(as_bits(worker.layers[index])).copy_(self.full[index][:, :, :, worker.heads.heads])

    def step(
        self, req_id: str, prompt: list[int], block_ids: list[int], write_layer=None
    ) -> tuple[StepPlan, WorkerReport]:
        """One prefill step of the whole prompt, each rank in turn in vLLM's hook order; the scheduler gets
        the merged report (and commits the stores whose parts are all in). ``write_layer(rank, l)``: the
        "attention layer" l of a rank, whose kernels write its KV."""
        s = self.scheduler
        s.add_request(req_id, prompt, None, None)
        external = s.match(req_id, 0)
        s.allocated(req_id, external, 0)
        plan = s.plan_step([ScheduledRequest(req_id, external, len(prompt) - external, block_ids)])
        report = WorkerReport()
        for rank, hooks in enumerate(self.ranks):
            hooks.start_load(plan)
            for index in range(self.layout.num_layers):
                hooks.wait_layer(index)
                if write_layer is not None:
                    write_layer(rank, index)
                hooks.save_layer(index, plan)
            hooks.wait_for_save(plan)
            hooks.load_errors()
            report = report.merged(WorkerReport(hooks.take_outcomes(), hooks.take_store_parts()))
        s.on_report(report)
        s.finish(req_id)
        return plan, report

    def rank_tokens(self, rank: int, start: int, num: int, block_ids: list[int]) -> torch.Tensor:
        """K and V of prompt tokens ``start ..`` in rank ``rank``'s tensors as integers, ``[L, 2, T, h, D]``."""
        worker = self.ranks[rank].worker
        return as_bits(
            torch.stack([reference_gather(layer.cpu(), worker.paged, start, num, block_ids) for layer in worker.layers])
        )

    def full_tokens(self, start: int, num: int, block_ids: list[int]) -> torch.Tensor:
        """The same tokens of the full-head KV the ranks shard, ``[L, 2, T, H, D]``."""
        positions = torch.arange(start, start + num)
        blocks = torch.as_tensor(block_ids)[positions // self.block_size].to(self.full[0].device)
        offsets = (positions % self.block_size).to(self.full[0].device)
        return torch.stack([layer[:, blocks, offsets].cpu() for layer in self.full])

    def close(self) -> None:
        self.scheduler.close()
        for hooks in self.ranks:
            hooks.worker.close()
