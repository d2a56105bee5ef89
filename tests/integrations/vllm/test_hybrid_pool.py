"""A hybrid model's connector sides over vLLM-shaped CPU tensors and a real pool (no vLLM needed): checkpoints
stored where steps end on their chunks, a load that ends at the deepest checkpoint with its GDN state, never past it.
"""

import dataclasses

import torch

from kvshare.integrations.vllm.hybrid import HybridGroups
from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.integrations.vllm.state_blocks import HKV, StateBlocks
from kvshare.keys import chunk_keys, namespace_digest, state_key
from kvshare.pool import protocol as P
from kvshare.pool.client import PoolClient
from kvshare.pool.link import PoolLink
from kvshare.state_layout import StateLayout
from tests.integrations.vllm.pool_replicas import (  # noqa: F401 (pool_fixture: the fixture ``pool``)
    NAMESPACE,
    PROMPT,
    C,
    N,
    Replica,
    pool_fixture,
)

STATE = StateLayout(2, 2, 8, 8, 40, 4, "float32", "float32")
GROUPS = HybridGroups(1, (0,), ("model.layers.0.linear_attn", "model.layers.2.linear_attn"), (0, 0), N)
ATTN_A, ATTN_B = list(range(0, 10)), list(range(39, 29, -1))
STATE_A, STATE_B = list(range(10, 20)), list(range(20, 30))  # the GDN group's tables: other blocks of the pool
HYBRID_NAMESPACE = dataclasses.replace(NAMESPACE, state_layout_id=STATE.fingerprint())


class HybridReplica(Replica):
    """A replica whose GDN layers keep their state per block, as vLLM's align mode does."""

    def __init__(self, socket_path, name, seed, **config):
        super().__init__(socket_path, name, seed, state_checkpoint_chunks=2, **config)
        self.scheduler.close()
        self.scheduler = PoolScheduler(
            self.config,
            HYBRID_NAMESPACE,
            self.scheduler.page_bytes,
            N,
            PoolLink(socket_path, f"{name}-hybrid", clock=self.clock),
            clock=self.clock,
            hybrid=GROUPS,
            state_bytes=STATE.checkpoint_bytes,
        )
        gen = torch.Generator().manual_seed(seed + 100)
        self.states = [
            (torch.randn(40, 3, 40, generator=gen), torch.randn(40, *STATE.recurrent_shape, generator=gen))
            for _ in range(STATE.num_layers)
        ]
        self.worker.states = StateBlocks(STATE, self.states, HKV)  # vLLM CPU's order

    def prefill(self, req_id, prompt, attn, table):
        """vLLM's steps of one chunk each over the whole prompt, stores and checkpoints after each."""
        self.scheduler.add_request(req_id, prompt, None, None)
        assert self.scheduler.match(req_id, 0) == 0
        self.scheduler.allocated(req_id, 0, 0)
        for computed in range(0, len(prompt), C):
            n = min(C, len(prompt) - computed)
            plan = self.scheduler.plan_step([ScheduledRequest(req_id, computed, n, attn, (table, attn))])
            for spec in plan.stores:
                self.worker.store(spec)
            for spec in plan.state_stores:
                assert self.worker.store_state(spec) == 1

    def resume(self, req_id, prompt, attn, table):
        """B's lookup, vLLM's allocation and the load beside its steps; (tokens offered, the load's outcome)."""
        self.scheduler.add_request(req_id, prompt, None, None)
        offered = self.scheduler.match(req_id, 0)
        assert offered == 0 or self.scheduler.is_async(req_id)  # a hybrid's load always runs beside the steps
        self.scheduler.allocated(req_id, offered, 0, attn, (table, attn))
        plan = self.scheduler.plan_step([])
        outcomes = []
        for spec in plan.loads:
            loads = self.worker.start_async_load(spec)
            outcomes += loads.finish()[0]
        self.scheduler.on_report(WorkerReport(outcomes))
        return offered, (outcomes[0] if outcomes else None), plan


def state_at(replica, block):
    return [(conv[block].clone(), ssm[block].clone()) for conv, ssm in replica.states]


def test_b_resumes_at_the_deepest_checkpoint_with_its_state_and_never_past_it(pool):
    a, b = HybridReplica(pool, "A", 1), HybridReplica(pool, "B", 2)
    try:
        a.prefill("r", PROMPT, ATTN_A, STATE_A)  # 300 tokens: checkpoints after chunks 2 and 4
        with PoolClient(pool, name="test") as client:
            assert client.stats()["checkpoints"] == 2
        offered, outcome, plan = b.resume("r1", PROMPT, ATTN_B, STATE_B)
        assert offered == 4 * C and outcome.is_complete  # the deepest checkpoint; the last block's tokens computed
        assert plan.loads[0].state_blocks == (STATE_B[4 * C // N - 1],) * 2
        for (conv_b, ssm_b), (conv_a, ssm_a) in zip(state_at(b, STATE_B[7]), state_at(a, STATE_A[7])):
            assert torch.equal(conv_b, conv_a) and torch.equal(ssm_b, ssm_a)
        assert torch.equal(b.tokens(0, 4 * C, ATTN_B), a.tokens(0, 4 * C, ATTN_A))

        keys = chunk_keys(namespace_digest(HYBRID_NAMESPACE), PROMPT, C)
        with PoolClient(pool, name="test") as client:
            assert client.drop([state_key(keys[3])]) == 1  # the deeper checkpoint gone: KV of 4 chunks still there
        offered, outcome, plan = b.resume("r2", PROMPT, ATTN_B, STATE_B)
        assert offered == 2 * C and len(plan.loads[0].pages) == 2  # no KV past the checkpoint it resumes from

        with PoolClient(pool, name="test") as client:
            assert client.drop([state_key(keys[1])]) == 1
        offered, outcome, plan = b.resume("r3", PROMPT, ATTN_B, STATE_B)
        assert offered == 0 and not plan.loads  # KV without any checkpoint: computed, not guessed
    finally:
        a.close(), b.close()


def test_a_bad_checkpoint_fails_the_whole_load_and_leaves_the_pool(pool):
    a, b = HybridReplica(pool, "A", 1), HybridReplica(pool, "B", 2)
    try:
        a.prefill("r", PROMPT, ATTN_A, STATE_A)
        before = state_at(b, STATE_B[7])
        keys = chunk_keys(namespace_digest(HYBRID_NAMESPACE), PROMPT, C)
        with PoolClient(pool, name="vandal") as client:
            candidate = P.StateCandidate(key=state_key(keys[3]), num_kv=4)
            grant = client.lookup(keys, b.scheduler.page_bytes, lease=False, states=[candidate],
                                  state_page_bytes=STATE.checkpoint_bytes)  # fmt: skip
            page = client.page(grant.state.page.offset, grant.state.page.page_bytes)
            page[:8] = 255 - page[:8]
        offered, outcome, _ = b.resume("r1", PROMPT, ATTN_B, STATE_B)
        assert offered == 4 * C and outcome.loaded_end == outcome.token_start and "GDN checkpoint" in outcome.reason
        assert b.worker.counters.checksum_failures == 1
        for (conv_b, ssm_b), (conv_0, ssm_0) in zip(state_at(b, STATE_B[7]), before):
            assert torch.equal(conv_b, conv_0) and torch.equal(ssm_b, ssm_0)  # nothing of it copied
        offered, _, _ = b.resume("r2", PROMPT, ATTN_B, STATE_B)
        assert offered == 2 * C  # dropped: the next lookup resumes from the one before
    finally:
        a.close(), b.close()
