"""Tensor parallel ranks on the connector's GPU path on a real GPU (suite gpu; skipped without CUDA).

The ranks of one replica simulated in one process on one GPU: each a staged worker over vLLM-shaped
FLASH_ATTN tensors holding its heads (TP=2 over 8 heads: 4 each; TP=4 over 2 heads: each head on two
ranks). The ranks store their heads into the reserved pages (2-D device -> host copies of the slice's
width) with their WSUM32 parts summed on the GPU, each layer written behind a delay on vLLM's stream;
a TP=1 replica loads the pages bit for bit, and the ranks load their heads of a TP=1 replica's pages.
The same checks run under the fake CUDA on CPU in test_staged_tp.py.
"""

import pytest
import torch

from kvshare.integrations.vllm.gpu import GpuKVWorker
from kvshare.integrations.vllm.layout import as_bits
from kvshare.integrations.vllm.tensor_parallel import partial_wsum32
from kvshare.layout import KVLayout
from kvshare.pool.checksum import MOD64, wsum32
from kvshare.transfer.base import TransferConfig
from tests.integrations.vllm.staged_replica import Replica
from tests.integrations.vllm.staged_tp import StagedTPReplica
from tests.integrations.vllm.test_cuda import flushed, pool  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

L, D, N, C = 4, 128, 16, 64
NUM_BLOCKS, NUM_CHUNKS = 48, 4
PROMPT = list(range(9, 9 + NUM_CHUNKS * C + 10))  # four chunks and a tail
BLOCKS_A, BLOCKS_B = list(range(0, 24)), list(range(47, 23, -1))
CASES = [(8, 2, "bfloat16"), (2, 4, "bfloat16"), (8, 2, "float8_e4m3fn")]  # (KV heads, TP, KV dtype)


def layout_of(heads: int, dtype: str) -> KVLayout:
    return KVLayout(num_layers=L, num_kv_heads=heads, head_dim=D, dtype=dtype, chunk_tokens=C)


def transfer_of(layout: KVLayout, copies: str) -> TransferConfig:
    """``layer_groups``: a group per layer (a rank's store: a 2-D copy per page); ``whole_pages``: one group
    of every layer (one 2-D copy per run of pages). Three pages per staging buffer."""
    row = layout.layer_bytes if copies == "layer_groups" else layout.page_bytes
    return TransferConfig(min_copy_bytes=row, staging_bytes=3 * row)


def tp1_replica(socket_path, name, layout, transfer):
    return Replica(
        socket_path, name, layout, "LBNHC", NUM_BLOCKS, N, torch.device("cuda"), worker_kwargs={"transfer": transfer}
    )


def tp_replica(socket_path, name, layout, tp, seed, transfer):
    return StagedTPReplica(socket_path, name, layout, "LBNHC", NUM_BLOCKS, N, torch.device("cuda"), tp, seed, transfer)


@pytest.mark.parametrize("copies", ["layer_groups", "whole_pages"])
@pytest.mark.parametrize("heads,tp,dtype", CASES)
def test_ranks_store_their_heads_on_cuda_and_tp1_loads_them_bitwise(flushed, heads, tp, dtype, copies):  # noqa: F811
    layout = layout_of(heads, dtype)
    transfer = transfer_of(layout, copies)
    ranks = tp_replica(flushed, "T", layout, tp, 1, transfer)
    reader = tp1_replica(flushed, "R", layout, transfer)
    try:
        assert all(isinstance(hooks.worker, GpuKVWorker) and hooks.worker.pipeline.is_sliced for hooks in ranks.ranks)
        for hooks in ranks.ranks:  # stale KV until each layer's "attention" writes it, behind a delay
            for layer in hooks.worker.layers:
                as_bits(layer).zero_()

        def produce(rank, index):
            torch.cuda._sleep(20_000_000)
            ranks.write_heads(rank, index)

        plan, report = ranks.step("a", PROMPT, BLOCKS_A, write_layer=produce)
        (spec,) = plan.stores
        assert len(report.stores) == tp and all(p.is_written for p in report.stores)
        assert ranks.scheduler.counters.stored_chunks == NUM_CHUNKS
        client = reader.worker.link.client()
        pages = [client.page(offset, layout.page_bytes) for _, offset in spec.grants]
        for part in report.stores:  # each writer's part, summed on the GPU, equals the host's over the page
            rank_heads = ranks.ranks[part.tp_rank].worker.heads
            expected = [partial_wsum32(page, layout, rank_heads) if rank_heads.is_writer else 0 for page in pages]
            assert list(part.checksums) == expected
        for i, page in enumerate(pages):
            assert sum(p.checksums[i] for p in report.stores) % MOD64 == wsum32(page)

        outcome = reader.step("b", PROMPT, BLOCKS_B)
        assert outcome.is_complete and outcome.loaded_end == NUM_CHUNKS * C
        assert reader.worker.counters.verified_pages == NUM_CHUNKS  # on the GPU, WSUM32 of whole pages
        loaded = NUM_CHUNKS * C
        assert torch.equal(reader.tokens(0, loaded, BLOCKS_B), ranks.full_tokens(0, loaded, BLOCKS_A))
    finally:
        ranks.close(), reader.close()


@pytest.mark.parametrize("heads,tp,dtype", CASES)
def test_each_rank_loads_its_heads_of_a_tp1_replicas_pages_on_cuda(flushed, heads, tp, dtype):  # noqa: F811
    layout = layout_of(heads, dtype)
    transfer = transfer_of(layout, "layer_groups")
    stored = tp1_replica(flushed, "W", layout, transfer)
    ranks = tp_replica(flushed, "T", layout, tp, 2, transfer)
    try:
        stored.fill(3)
        stored.step("w", PROMPT, BLOCKS_A)
        assert stored.worker.counters.stored_chunks == NUM_CHUNKS
        _, report = ranks.step("b", PROMPT, BLOCKS_B)
        assert len(report.loads) == tp and all(o.is_complete and o.loaded_end == NUM_CHUNKS * C for o in report.loads)
        whole = stored.tokens(0, NUM_CHUNKS * C, BLOCKS_A)  # [L, 2, T, H, D]
        for rank, hooks in enumerate(ranks.ranks):
            assert hooks.worker.counters.verified_pages == NUM_CHUNKS
            loaded = ranks.rank_tokens(rank, 0, NUM_CHUNKS * C, BLOCKS_B)
            assert torch.equal(loaded, whole[:, :, :, hooks.worker.heads.heads])
    finally:
        stored.close(), ranks.close()
