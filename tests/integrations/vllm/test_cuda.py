"""The connector's worker side on CUDA with vLLM-shaped flash-attention tensors (suite gpu; no vLLM needed).

GPU vLLM cannot run on the machines here; these tests run the worker's CUDA path (pool
page -> device blocks, device blocks -> pool page) on tensors shaped and strided like
vLLM 0.32's FLASH_ATTN caches, against a real pool, with a delayed producer.
"""

import pytest
import torch

from kvshare.integrations.vllm.layout import detect_layout, reference_gather
from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.integrations.vllm.pool_link import PoolLink
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.integrations.vllm.worker import PoolKVWorker
from kvshare.keys import Namespace
from kvshare.layout import KVLayout
from kvshare.pool.spawn import running_pool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

L, H, D, N, C = 4, 8, 128, 16, 256
NUM_BLOCKS = 96
DTYPE = torch.bfloat16
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16", chunk_tokens=C)
NAMESPACE = Namespace("gpu-test", "f" * 32, "bfloat16", L, H, D, chunk_tokens=C, engine_family="vllm")
PROMPT = list(range(5, 5 + 3 * C + 40))  # three chunks and a tail


def flash_layers(physical: str) -> list[torch.Tensor]:
    """Per-layer [B, H, N, 2D] views as vLLM 0.32 makes them (LBNHC: NHD memory) or the 5-D form."""
    if physical == "LBNHC":
        return [torch.randn(NUM_BLOCKS, N, H, 2 * D, device="cuda", dtype=DTYPE).permute(0, 2, 1, 3) for _ in range(L)]
    if physical == "5d":
        return [torch.randn(2, NUM_BLOCKS, N, H, D, device="cuda", dtype=DTYPE) for _ in range(L)]
    return [torch.randn(NUM_BLOCKS, H, N, 2 * D, device="cuda", dtype=DTYPE) for _ in range(L)]


def replica(socket_path, name, physical):
    config = ConnectorConfig(pool_socket=socket_path, chunk_tokens=C, replica=name)
    scheduler = PoolScheduler(config, NAMESPACE, LAYOUT.page_bytes, N, PoolLink(socket_path, f"{name}-s"))
    worker = PoolKVWorker(LAYOUT, PoolLink(socket_path, f"{name}-w"))
    layers = flash_layers(physical)
    worker.register(layers, detect_layout("FLASH_ATTN", layers[0], H, D, N, DTYPE))
    return scheduler, worker, layers


def tokens(worker, layers, start, num, block_ids):
    return torch.stack([reference_gather(layer.cpu(), worker.paged, start, num, block_ids) for layer in layers])


@pytest.mark.parametrize("physical", ["LBNHC", "LBHNC", "5d"])
def test_cross_replica_bytes_on_cuda_with_a_delayed_producer(physical):
    blocks_a = list(range(0, 50))
    blocks_b = list(range(95, 45, -1))
    with running_pool("256MiB", ("--extent-size", "64MiB")) as socket_path:
        sa, wa, layers_a = replica(socket_path, "A", physical)
        sb, wb, layers_b = replica(socket_path, "B", physical)
        try:
            sa.add_request("a", PROMPT, None, None)
            assert sa.match("a", 0) == 0
            sa.allocated("a", 0, 0)
            plan = sa.plan_step([ScheduledRequest("a", 0, len(PROMPT), blocks_a)])
            # the producer: a long sleep on the compute stream, then the KV is written behind it
            fresh = [torch.randn_like(layer) for layer in layers_a]
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles
            for layer, values in zip(layers_a, fresh):
                layer.copy_(values)
            for spec in plan.stores:  # must wait for the writes above (same stream), not copy stale bytes
                assert wa.store(spec) == 3

            sb.add_request("b", PROMPT, None, None)
            external = sb.match("b", 0)
            assert external == 3 * C
            sb.allocated("b", external, 0)
            plan = sb.plan_step([ScheduledRequest("b", external, len(PROMPT) - external, blocks_b)])
            outcome = wb.load(plan.loads[0])
            sb.on_report(WorkerReport([outcome]))
            assert outcome.is_complete
            assert torch.equal(tokens(wb, layers_b, 0, 3 * C, blocks_b), tokens(wa, layers_a, 0, 3 * C, blocks_a))
            assert wb.counters.load_bytes == 3 * LAYOUT.page_bytes
        finally:
            sa.close(), sb.close()
            wa.link.close(), wb.link.close()
