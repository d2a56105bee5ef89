"""Tensor parallel ranks on the connector's GPU path, on CPU tensors under the fake CUDA (see test_staged.py).

TP=2 ranks (2 of 4 heads or 1 of 2 each) and TP=4 ranks over 2 heads (each head replicated on two
ranks, one of them writing) store their heads into pages the scheduler reserved, through GPU staging
and 2-D copies of the slice's width; the parts of each page's WSUM32 summed on the "GPU" equal the
host's ``partial_wsum32`` and add up to the page's; a TP=1 replica loads the pages bit for bit, and
each rank loads its heads of pages a TP=1 replica stored. A rank that writes the wrong heads is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvshare.integrations.vllm.tensor_parallel import head_slice, partial_wsum32
from kvshare.layout import KVLayout
from kvshare.pool.checksum import MOD64, ChecksumKind, page_checksum, wsum32
from kvshare.pool.client import PoolClient
from kvshare.pool.wsum import add_head_rows, as_unsigned
from kvshare.transfer.base import TransferConfig
from kvshare.transfer.plan import head_copies, layer_groups, plan_unit
from tests.integrations.vllm.staged_replica import Replica
from tests.integrations.vllm.staged_tp import StagedTPReplica
from tests.integrations.vllm.test_staged import (  # noqa: F401
    CPU,
    NUM_BLOCKS,
    PROMPT,
    N,
    blocks_a,
    blocks_b,
    fake,
    flushed,
    pool,
)

CASES = [(4, 2), (2, 2), (2, 4)]  # (KV heads, TP): 2 heads per rank, 1 per rank, 1 head replicated on 2 ranks
NUM_CHUNKS = 10  # PROMPT's full chunks


def layout_of(num_kv_heads: int) -> KVLayout:
    return KVLayout(num_layers=4, num_kv_heads=num_kv_heads, head_dim=16, dtype="bfloat16", chunk_tokens=32)


def transfer_of(layout: KVLayout, copies: str) -> TransferConfig:
    """``layer_groups``: a group per layer (a rank's store: a 2-D copy per page), 3 pages per staging buffer;
    ``whole_pages``: one group of every layer (one 2-D copy per run of pages)."""
    row = layout.layer_bytes if copies == "layer_groups" else layout.page_bytes
    return TransferConfig(min_copy_bytes=row, staging_bytes=3 * row)


def tp1_replica(socket_path, name, layout, transfer, staged=True):
    order = "LBNHC" if staged else "cpu_attn"
    return Replica(
        socket_path, name, layout, order, NUM_BLOCKS, N, CPU, staged=staged, worker_kwargs={"transfer": transfer}
    )


def count_store_copies(monkeypatch, ranks: StagedTPReplica) -> list[list]:
    """Per rank, the device -> host copies its staging enqueues (appended as they happen)."""
    calls: list[list] = [[] for _ in ranks.ranks]
    for rank, hooks in enumerate(ranks.ranks):
        engine = hooks.worker.pipeline
        real = engine.host_copies

        def recording(copies, buffer, stream, client, to_device, real=real, rank=rank):
            if not to_device:
                calls[rank].extend(copies)
            real(copies, buffer, stream, client, to_device)

        monkeypatch.setattr(engine, "host_copies", recording)
    return calls


@pytest.mark.parametrize("copies", ["layer_groups", "whole_pages"])
@pytest.mark.parametrize("heads,tp", CASES)
def test_ranks_store_their_heads_with_their_wsum_parts_and_tp1_loads_them_bitwise(
    fake, flushed, monkeypatch, heads, tp, copies
):
    layout = layout_of(heads)
    transfer = transfer_of(layout, copies)
    ranks = StagedTPReplica(flushed, "T", layout, "LBNHC", NUM_BLOCKS, N, CPU, tp, seed=1, transfer=transfer)
    reader = tp1_replica(flushed, "R", layout, transfer)
    try:
        store_copies = count_store_copies(monkeypatch, ranks)
        plan, report = ranks.step("a", PROMPT, blocks_a())
        (spec,) = plan.stores
        assert sorted(p.tp_rank for p in report.stores) == list(range(tp)) and all(p.is_written for p in report.stores)
        assert ranks.scheduler.counters.stored_chunks == NUM_CHUNKS
        client = reader.worker.link.client()
        pages = [client.page(offset, layout.page_bytes) for _, offset in spec.grants]
        for part in report.stores:
            rank_heads = ranks.ranks[part.tp_rank].worker.heads
            if rank_heads.is_writer:  # summed on the "GPU" from its staged heads == the host's, from the page
                assert list(part.checksums) == [partial_wsum32(page, layout, rank_heads) for page in pages]
                assert store_copies[part.tp_rank]
                assert {c.width for c in store_copies[part.tp_rank]} == {rank_heads.num_heads * 16 * 2}
            else:  # a replicated head another rank writes: nothing copied, 0 reported
                assert list(part.checksums) == [0] * len(pages) and store_copies[part.tp_rank] == []
        for i, page in enumerate(pages):
            assert sum(p.checksums[i] for p in report.stores) % MOD64 == wsum32(page)
        lease = client.lookup([spec.keys[index] for index, _ in spec.grants], layout.page_bytes, lease=False)
        assert [p.checksum for p in lease.pages] == [wsum32(page) for page in pages]
        assert {p.checksum_kind for p in lease.pages} == {ChecksumKind.WSUM32}

        outcome = reader.step("b", PROMPT, blocks_b())
        assert outcome.is_complete and outcome.loaded_end == NUM_CHUNKS * 32
        assert reader.worker.counters.verified_pages == NUM_CHUNKS
        loaded = NUM_CHUNKS * 32
        assert torch.equal(reader.tokens(0, loaded, blocks_b()), ranks.full_tokens(0, loaded, blocks_a()))
    finally:
        ranks.close(), reader.close()


@pytest.mark.parametrize("writer", ["staged", "cpu"])
@pytest.mark.parametrize("heads,tp", CASES)
def test_each_rank_loads_its_heads_of_pages_a_tp1_replica_stored(fake, flushed, heads, tp, writer):
    layout = layout_of(heads)
    transfer = transfer_of(layout, "layer_groups")
    stored = tp1_replica(flushed, "W", layout, transfer, staged=writer == "staged")  # WSUM32 or xxh3 pages
    ranks = StagedTPReplica(flushed, "T", layout, "LBNHC", NUM_BLOCKS, N, CPU, tp, seed=2, transfer=transfer)
    try:
        stored.fill(3)
        stored.step("w", PROMPT, blocks_a())
        assert stored.worker.counters.stored_chunks == NUM_CHUNKS
        before = [ranks.rank_tokens(rank, 0, len(PROMPT), blocks_b()) for rank in range(tp)]
        plan, report = ranks.step("b", PROMPT, blocks_b())
        assert len(report.loads) == tp and all(o.is_complete and o.loaded_end == NUM_CHUNKS * 32 for o in report.loads)
        whole = stored.tokens(0, NUM_CHUNKS * 32, blocks_a())  # [L, 2, T, H, D]
        for rank, hooks in enumerate(ranks.ranks):
            assert hooks.worker.counters.verified_pages == NUM_CHUNKS  # every rank checks whole pages
            loaded = ranks.rank_tokens(rank, 0, len(PROMPT), blocks_b())
            assert torch.equal(loaded[:, :, : NUM_CHUNKS * 32], whole[:, :, :, hooks.worker.heads.heads])
            assert torch.equal(loaded[:, :, NUM_CHUNKS * 32 :], before[rank][:, :, NUM_CHUNKS * 32 :])  # the tail
    finally:
        stored.close(), ranks.close()


def test_a_rank_writing_the_wrong_heads_is_caught(fake, flushed, monkeypatch):
    """Negative control: rank 1 of 2 writes its heads into rank 0's columns (heads 0-1 instead of 2-3). Its
    reported part no longer matches the page, the summed checksum is not the page's, and a reader's
    verification stops the load at the first page."""
    layout = layout_of(4)
    transfer = transfer_of(layout, "layer_groups")
    ranks = StagedTPReplica(flushed, "T", layout, "LBNHC", NUM_BLOCKS, N, CPU, 2, seed=4, transfer=transfer)
    reader = tp1_replica(flushed, "R", layout, transfer)
    try:
        wrong = ranks.ranks[1].worker.pipeline
        monkeypatch.setattr(wrong, "store_copies", lambda unit: head_copies(unit, layout, 0, 2))
        plan, report = ranks.step("a", PROMPT, blocks_a())
        (spec,) = plan.stores
        client = reader.worker.link.client()
        pages = [client.page(offset, layout.page_bytes) for _, offset in spec.grants]
        part = next(p for p in report.stores if p.tp_rank == 1)
        for i, page in enumerate(pages):
            assert part.checksums[i] != partial_wsum32(page, layout, head_slice(4, 1, 2))
            assert sum(p.checksums[i] for p in report.stores) % MOD64 != wsum32(page)
        outcome = reader.step("b", PROMPT, blocks_b())
        assert outcome.loaded_end == 0 and "checksum mismatch" in outcome.reason
    finally:
        ranks.close(), reader.close()


def test_a_rank_that_cannot_reach_the_pool_aborts_the_pages(fake, flushed):
    layout = layout_of(4)
    ranks = StagedTPReplica(
        flushed, "T", layout, "LBNHC", NUM_BLOCKS, N, CPU, 2, seed=5, transfer=transfer_of(layout, "layer_groups")
    )
    try:
        ranks.ranks[1].worker.pool.client_for = lambda pid: (None, "injected: the pool is unreachable")
        _, report = ranks.step("a", PROMPT, blocks_a())
        assert [p.is_written for p in sorted(report.stores, key=lambda p: p.tp_rank)] == [True, False]
        with PoolClient(flushed, name="check") as check:
            stats = check.stats()
        assert stats["entries"] == 0 and stats["writing"] == 0  # aborted: never visible, no page held
    finally:
        ranks.close()


@pytest.mark.parametrize("num_layers_per_group", [1, 4])
def test_head_copies_write_only_the_slices_columns(num_layers_per_group):
    layout = layout_of(4)
    P = layout.page_bytes
    offsets = [0, P, 2 * P, 5 * P]  # two runs: pages 0-2 and page 3
    rng = np.random.default_rng(0)
    arena = rng.integers(0, 256, 6 * P, dtype=np.uint8)
    original = arena.copy()
    heads = head_slice(4, 1, 2)  # heads 2-3
    for l0 in range(0, layout.num_layers, num_layers_per_group):
        unit = plan_unit(offsets, layout, (l0, l0 + num_layers_per_group), (0, len(offsets)), None)
        staged = rng.integers(0, 256, unit.num_bytes // 2, dtype=np.uint8)  # [n, g, 2, C, h, D] bytes
        for c in head_copies(unit, layout, heads.first_head, heads.num_heads):
            for row in range(c.height):
                host, stage = c.host_offset + row * c.host_pitch, c.stage_offset + row * c.width
                arena[host : host + c.width] = staged[stage : stage + c.width]
        shape = (unit.num_pages, num_layers_per_group, 2, layout.chunk_tokens, heads.num_heads, 16 * 2)
        written = np.stack([arena[o : o + P] for o in offsets]).reshape(len(offsets), layout.num_layers, 2, 32, 4, 32)
        assert np.array_equal(written[:, l0 : l0 + num_layers_per_group, :, :, 2:], staged.reshape(shape))
    pages = np.stack([arena[o : o + P] for o in offsets]).reshape(len(offsets), layout.num_layers, 2, 32, 4, 32)
    before = np.stack([original[o : o + P] for o in offsets]).reshape(pages.shape)
    assert np.array_equal(pages[..., :2, :], before[..., :2, :])  # the other rank's heads untouched
    assert np.array_equal(arena[3 * P : 5 * P], original[3 * P : 5 * P])  # and the pages between the runs


@pytest.mark.parametrize("heads,tp", CASES + [(8, 4)])
def test_head_sums_of_staged_slices_in_layer_groups_equal_the_hosts_partial_wsum(heads, tp):
    layout = layout_of(heads)
    page = np.random.default_rng(1).integers(0, 256, layout.page_bytes, dtype=np.uint8)
    words = torch.from_numpy(page.copy()).view(torch.int32).view(layout.num_layers * 2 * 32, heads, -1)
    parts = []
    for rank in range(tp):
        s = head_slice(heads, rank, tp)
        acc = torch.zeros(1, dtype=torch.int64)
        for l0, l1 in reversed(layer_groups(layout.num_layers, layout.layer_bytes, layout.layer_bytes)):  # any order
            rows = words[l0 * 64 : l1 * 64, s.heads].contiguous()  # as staged: this rank's heads packed
            add_head_rows(acc, rows[None], l0 * 64, s.first_head, heads)
        assert as_unsigned(acc) == [partial_wsum32(page, layout, s)]
        parts += as_unsigned(acc) if s.is_writer else []
    assert sum(parts) % MOD64 == wsum32(page) == page_checksum(page, ChecksumKind.WSUM32)


def test_one_rank_with_every_head_stages_as_before(fake, flushed):
    """TP=1: no head slicing anywhere (the same copies, views and sums as before tensor parallelism)."""
    layout = layout_of(4)
    reader = tp1_replica(flushed, "R", layout, transfer_of(layout, "layer_groups"))
    try:
        pipeline, kv = reader.worker.pipeline, reader.worker.paged_kv
        unit = plan_unit([0, layout.page_bytes], layout, (0, 1), (0, 2), None)
        buffer = pipeline.store_lane.buffers[0]
        assert not pipeline.is_sliced and not kv.is_sliced and pipeline.store_copies(unit) is unit.copies
        staged = pipeline.staged(buffer, unit)
        assert kv.own_heads(staged) is staged
        assert pipeline.packed(buffer, unit).shape == staged.shape
    finally:
        reader.close()
