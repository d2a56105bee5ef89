"""Tensor parallel replicas against a real pool, with vLLM-shaped CPU tensors (no vLLM needed).

A TP=2 replica is one scheduler side (tp_size 2) and two worker ranks, each holding its heads of
every layer; pages hold all heads. Bytes a TP=2 replica stores load into a TP=1 replica and the
reverse; a page is visible only once every rank's part is in; a failed load on any rank counts.
"""

import numpy as np
import pytest
import torch

from kvshare.integrations.vllm.cpu import CpuKVWorker
from kvshare.integrations.vllm.layout import PagedLayout, reference_gather
from kvshare.integrations.vllm.metadata import StorePart, WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.integrations.vllm.tensor_parallel import PartedStores, head_slice, partial_wsum32
from kvshare.integrations.vllm.worker import WorkerHooks
from kvshare.keys import chunk_keys, namespace_digest
from kvshare.layout import KVLayout
from kvshare.pool.checksum import MOD64, wsum32
from kvshare.pool.client import PoolClient
from kvshare.pool.link import PoolLink
from tests.integrations.vllm.pool_replicas import (  # noqa: F401
    BLOCKS_A,
    BLOCKS_B,
    LAYOUT,
    NAMESPACE,
    NUM_BLOCKS,
    PROMPT,
    C,
    D,
    H,
    L,
    N,
    Replica,
    pool_fixture,
    pool_stats,
)


def test_head_slices_follow_vllms_sharding():
    assert [(s.first_head, s.num_heads, s.is_writer) for s in (head_slice(4, r, 2) for r in range(2))] == [
        (0, 2, True),
        (2, 2, True),
    ]
    # fewer KV heads than ranks: head r // (T / H), the first rank of each replica group writes it
    assert [(s.first_head, s.is_writer) for s in (head_slice(2, r, 4) for r in range(4))] == [
        (0, True),
        (0, False),
        (1, True),
        (1, False),
    ]
    assert head_slice(8, 0, 1).num_heads == 8
    with pytest.raises(ValueError, match="do not divide"):
        head_slice(6, 0, 4)
    with pytest.raises(ValueError, match="replicate"):
        head_slice(2, 0, 3)


@pytest.mark.parametrize(
    "dtype,heads,tp", [("float32", 2, 2), ("bfloat16", 4, 2), ("float8_e4m3fn", 8, 4), ("bfloat16", 2, 4)]
)
def test_the_ranks_partial_wsums_add_up_to_the_pages(dtype, heads, tp):
    layout = KVLayout(num_layers=3, num_kv_heads=heads, head_dim=32, dtype=dtype, chunk_tokens=64)
    page = np.random.default_rng(0).integers(0, 256, layout.page_bytes, dtype=np.uint8)
    parts = [partial_wsum32(page, layout, s) for s in (head_slice(heads, r, tp) for r in range(tp)) if s.is_writer]
    assert sum(parts) % MOD64 == wsum32(page)
    book = PartedStores(tp)
    book.expect(7, b"p" * 16)
    for rank, part in enumerate(parts + [0] * (tp - len(parts))):
        done = book.add(StorePart(7, b"p" * 16, rank, True, (part, 0)))
    assert done == (7, [wsum32(page), 0]) and not len(book)


class TPReplica:
    """A TP=``tp`` replica: one scheduler side, ``tp`` worker ranks over fake CPU_ATTN tensors (their heads)."""

    def __init__(self, socket_path, name, seed, tp=2):
        config = ConnectorConfig(pool_socket=socket_path, chunk_tokens=C, replica=name)
        self.scheduler = PoolScheduler(
            config, NAMESPACE, LAYOUT.page_bytes, N, PoolLink(socket_path, f"{name}-s"), tp_size=tp
        )
        gen = torch.Generator().manual_seed(seed)
        self.full = [torch.randn(NUM_BLOCKS, H, N, 2 * D, generator=gen) for _ in range(L)]  # all heads, as TP=1
        self.ranks = []
        for rank in range(tp):
            heads = head_slice(H, rank, tp)
            worker = CpuKVWorker(LAYOUT, PoolLink(socket_path, f"{name}-w{rank}"), heads=heads)
            layers = [layer[:, heads.heads].contiguous() for layer in self.full]  # [B, h, N, 2D]
            worker.register(layers, PagedLayout("cpu_attn", NUM_BLOCKS, N, heads.num_heads, D, torch.float32))
            self.ranks.append(WorkerHooks(worker, N))

    def step(self, req_id, prompt, block_ids, computed=0, fail_store_on=None, fail_load_on=None):
        """One prefill step of the whole prompt on every rank; the scheduler gets the merged report."""
        s = self.scheduler
        s.add_request(req_id, prompt, None, None)
        external = s.match(req_id, computed)
        s.allocated(req_id, external, computed)
        plan = s.plan_step(
            [ScheduledRequest(req_id, computed + external, len(prompt) - computed - external, block_ids)]
        )
        report = WorkerReport()
        for rank, hooks in enumerate(self.ranks):
            if rank == fail_load_on:
                hooks.worker.pool.client_for = lambda pid: (None, "injected: rank cannot reach the pool")
            hooks.start_load(plan)
            if rank == fail_store_on:
                hooks._failed_loads.add(req_id)  # as after a failed load: this rank refuses to store
            hooks.wait_for_save(plan)
            report = report.merged(WorkerReport(hooks.take_outcomes(), hooks.take_store_parts()))
        s.on_report(report)
        return external, report, s.finish(req_id)

    def rank_tokens(self, start, num, block_ids):
        """All heads, gathered rank by rank: [L, 2, T, H, D]."""
        per_rank = [
            torch.stack(
                [reference_gather(layer, hooks.worker.paged, start, num, block_ids) for layer in hooks.worker.layers]
            )
            for hooks in self.ranks
        ]
        return torch.cat(per_rank, dim=3)

    def close(self):
        self.scheduler.close()
        for hooks in self.ranks:
            hooks.worker.close()


def test_tp2_stores_load_into_tp1_and_tp1_stores_load_into_tp2(pool):  # noqa: F811
    tp2, tp1 = TPReplica(pool, "T2", seed=1), Replica(pool, "T1", seed=2)
    try:
        external, report, _ = tp2.step("r1", PROMPT, BLOCKS_A)
        assert external == 0 and len(report.stores) == 2  # one part per rank of the one reservation
        assert pool_stats(pool)["entries"] == 4 and tp2.scheduler.counters.stored_chunks == 4
        external, outcome = tp1.run_prefill("r2", PROMPT, BLOCKS_B)
        assert external == 256 and outcome.is_complete  # WSUM32 of the summed parts verified on the host
        assert torch.equal(tp1.tokens(0, 256, BLOCKS_B), tp2.rank_tokens(0, 256, BLOCKS_A))

        other = list(range(500, 800))
        tp1.run_prefill("r3", other, BLOCKS_A)  # TP=1 stores (xxh3) ...
        fresh = TPReplica(pool, "T2b", seed=3)
        try:
            external, report, origin = fresh.step("r4", other, BLOCKS_B)  # ... each rank loads its heads
            assert external == 256 and origin["pool_tokens"] == 256
            assert all(o.is_complete for o in report.loads) and len(report.loads) == 2
            assert torch.equal(fresh.rank_tokens(0, 256, BLOCKS_B), tp1.tokens(0, 256, BLOCKS_A))
        finally:
            fresh.close()
    finally:
        tp2.close(), tp1.close()


def test_a_rank_that_cannot_write_its_part_aborts_the_pages(pool):  # noqa: F811
    tp2 = TPReplica(pool, "T2", seed=1)
    try:
        _, report, _ = tp2.step("r1", PROMPT, BLOCKS_A, fail_store_on=1)
        assert [p.is_written for p in sorted(report.stores, key=lambda p: p.tp_rank)] == [True, False]
        stats = pool_stats(pool)
        assert stats["entries"] == 0 and stats["writing"] == 0  # aborted: never visible, no page held
        _, report, _ = tp2.step("r2", PROMPT, BLOCKS_A)  # the next request stores them whole
        assert pool_stats(pool)["entries"] == 4
    finally:
        tp2.close()


def test_a_rank_gone_mid_store_leaves_no_page(pool):  # noqa: F811
    """The scheduler's reservation outlives no rank: parts reported by rank 0 only, then the replica's
    processes are gone (vLLM stops the engine when a worker dies): the pool drops the reservation."""
    tp2 = TPReplica(pool, "T2", seed=1)
    s = tp2.scheduler
    s.add_request("r1", PROMPT, None, None)
    s.allocated("r1", s.match("r1", 0), 0)
    plan = s.plan_step([ScheduledRequest("r1", 0, len(PROMPT), BLOCKS_A)])
    hooks = tp2.ranks[0]
    hooks.start_load(plan)
    hooks.wait_for_save(plan)  # rank 0 wrote its heads into the reserved pages ...
    s.on_report(WorkerReport([], hooks.take_store_parts()))
    keys = chunk_keys(namespace_digest(NAMESPACE), PROMPT, C)
    with PoolClient(pool, name="reader") as reader:
        assert reader.lookup(keys, LAYOUT.page_bytes, lease=False).pages == []  # ... not visible
        tp2.close()  # ... rank 1 never reports; the replica goes
        assert reader.lookup(keys, LAYOUT.page_bytes, lease=False).pages == []
        assert reader.stats()["entries"] == 0


def test_a_load_that_fails_on_one_rank_is_recomputed_by_all(pool):  # noqa: F811
    tp1 = Replica(pool, "T1", seed=2)
    tp2 = TPReplica(pool, "T2", seed=1)
    try:
        tp1.run_prefill("r1", PROMPT, BLOCKS_A)
        invalid = []
        _, report, origin = tp2.step("r2", PROMPT, BLOCKS_B, fail_load_on=1)
        invalid = [hooks.load_errors() for hooks in tp2.ranks]
        assert not invalid[0] and invalid[1]  # vLLM unions these: every rank recomputes those blocks
        assert origin["pool_tokens"] == 0  # the tokens every rank loaded
        assert [p.is_written for p in report.stores] == []  # computed from a failed load: not stored
    finally:
        tp1.close(), tp2.close()
