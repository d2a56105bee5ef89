"""A hybrid model's GDN checkpoints through the GPU worker (gpu_states) on CPU tensors under the fake CUDA.

The GDN state tensors are shaped and strided as vLLM CUDA registers them (conv "SD", ssm [HV, V, K] in one page per
block); the pool's checkpoint is the canonical [HV, K, V]. The ordering itself needs a GPU (streams and events run in
program order here); what runs here is the whole data path: the store through the device buffer (transposed, summed
WSUM32), the load beside the steps into another replica's blocks, its check, and which stream waits for what.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvshare.integrations.vllm.hybrid import HybridGroups
from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.integrations.vllm.state_blocks import HVK, StateBlocks
from kvshare.keys import chunk_keys, namespace_digest, state_key
from kvshare.layout import KVLayout
from kvshare.pool import protocol as P
from kvshare.pool.checksum import ChecksumKind, page_checksum
from kvshare.pool.client import PoolClient
from kvshare.pool.link import PoolLink
from kvshare.pool.spawn import running_pool
from kvshare.state_layout import StateLayout
from kvshare.transfer.base import TransferConfig
from tests.integrations.vllm.staged_replica import Replica, namespace_of
from tests.integrations.vllm.test_hybrid_guards import cuda_gdn_tensors
from tests.transfer import fake_cuda

N = 8  # block size
C = 16  # chunk: two blocks
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=C)
SMALL = TransferConfig(min_copy_bytes=1 << 10, staging_bytes=8 << 10)
STATE = StateLayout(2, 4, 8, 4, 48, 4, "float32", "bfloat16")  # K = 8, V = 4: a missing transpose shows
GROUPS = HybridGroups(1, (0,), ("model.layers.0.linear_attn", "model.layers.1.linear_attn"), (0, 0), N)
NAMESPACE = dataclasses.replace(namespace_of(LAYOUT), state_layout_id=STATE.fingerprint())
PROMPT = list(range(5, 5 + 4 * C + 3))  # four chunks and a tail: checkpoints after chunks 2 and 4
NUM_BLOCKS = 48
ATTN_A, ATTN_B = list(range(0, 9)), list(range(47, 38, -1))
STATE_A, STATE_B = list(range(10, 19)), list(range(20, 29))  # the GDN group's tables


@pytest.fixture(scope="module")
def pool():
    with running_pool("4MiB", ("--extent-size", "256KiB")) as socket_path:
        yield socket_path


@pytest.fixture
def compute(pool, monkeypatch):
    """The fake CUDA with one stream as vLLM's (its waits counted), over a flushed pool; yields that stream."""
    fake_cuda.install(monkeypatch, fake_cuda.FakeCuda())
    stream = fake_cuda.FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    with PoolClient(pool, name="flush") as client:
        client.flush()
    return stream


def cuda_states(num_blocks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per GDN layer, [conv "SD", ssm [HV, V, K]] as vLLM CUDA's model runner registers them, random bytes."""
    return [cuda_gdn_tensors(STATE, num_blocks, seed * 10 + layer) for layer in range(STATE.num_layers)]


class HybridReplica(Replica):
    """A GPU replica (fake CUDA) whose GDN layers keep their state per block in vLLM CUDA's layout."""

    def __init__(self, socket_path: str, name: str, seed: int) -> None:
        super().__init__(
            socket_path, name, LAYOUT, "LBNHC", NUM_BLOCKS, N, torch.device("cpu"), staged=True,
            worker_kwargs={"transfer": SMALL}, state_checkpoint_chunks=2,
        )  # fmt: skip
        self.scheduler.close()
        link = PoolLink(socket_path, f"{name}-hybrid")
        self.scheduler = PoolScheduler(
            self.config, NAMESPACE, LAYOUT.page_bytes, N, link, hybrid=GROUPS, state_bytes=STATE.checkpoint_bytes
        )
        self.fill(seed)
        self.states = cuda_states(NUM_BLOCKS, seed)
        self.worker.states = StateBlocks(STATE, self.states, HVK)
        self.worker.register(self.layers, self.paged)  # as vLLM registers them: the GDN state first

    def prefill(self, req_id: str, attn: list[int], table: list[int]) -> None:
        """vLLM's steps of one chunk each over the whole prompt, stores and checkpoints after each."""
        self.scheduler.add_request(req_id, PROMPT, None, None)
        assert self.scheduler.match(req_id, 0) == 0
        self.scheduler.allocated(req_id, 0, 0)
        for computed in range(0, len(PROMPT), C):
            n = min(C, len(PROMPT) - computed)
            plan = self.scheduler.plan_step([ScheduledRequest(req_id, computed, n, attn, (table, attn))])
            for spec in plan.stores:
                self.worker.store(spec)
            for spec in plan.state_stores:
                assert self.worker.store_state(spec) == 1

    def plan_resume(self, req_id: str, attn: list[int], table: list[int]):
        """B's lookup and vLLM's allocation; the tokens offered and the step that carries the load."""
        self.scheduler.add_request(req_id, PROMPT, None, None)
        offered = self.scheduler.match(req_id, 0)
        assert self.scheduler.is_async(req_id)  # a hybrid's load always runs beside the steps
        self.scheduler.allocated(req_id, offered, 0, attn, (table, attn))
        return offered, self.scheduler.plan_step([])

    def resume(self, req_id: str, attn: list[int], table: list[int]):
        """The load beside vLLM's steps, finished; its outcome, reported to the scheduler side."""
        offered, plan = self.plan_resume(req_id, attn, table)
        assert offered == 4 * C  # the deepest checkpoint; the last chunk's tokens computed
        outcomes = []
        for spec in plan.loads:
            outcomes += self.worker.start_async_load(spec).finish()[0]
        self.scheduler.on_report(WorkerReport(outcomes))
        return outcomes[0], plan


def state_bits(replica: HybridReplica, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per GDN layer, block ``block``'s conv and ssm state as integers (NaN payloads compare equal)."""
    return [(c[block].view(torch.int16).clone(), s[block].view(torch.int32).clone()) for c, s in replica.states]


def checkpoint(pool_path: str, num_chunks: int):
    """The committed checkpoint after ``num_chunks`` chunks of PROMPT: its header and a copy of its bytes."""
    keys = chunk_keys(namespace_digest(NAMESPACE), PROMPT, C)
    candidate = P.StateCandidate(key=state_key(keys[num_chunks - 1]), num_kv=num_chunks)
    with PoolClient(pool_path, name="test") as client:
        grant = client.lookup(
            keys, LAYOUT.page_bytes, lease=False, states=[candidate], state_page_bytes=STATE.checkpoint_bytes
        )
        page = grant.state.page
        return page, client.page(page.offset, page.page_bytes).copy()


def test_a_checkpoint_goes_through_the_device_buffer_transposed_and_comes_back_into_the_other_replicas_blocks(
    pool, compute
):
    a, b = HybridReplica(pool, "A", 1), HybridReplica(pool, "B", 2)
    try:
        a.prefill("r", ATTN_A, STATE_A)  # checkpoints after chunks 2 and 4
        header, page = checkpoint(pool, 4)
        block_a = STATE_A[4 * C // N - 1]
        assert header.checksum_kind == ChecksumKind.WSUM32  # summed on the GPU at the store
        assert header.checksum == page_checksum(page, ChecksumKind.WSUM32)
        recurrent = torch.from_numpy(page[: STATE.recurrent_bytes].copy()).view(torch.int32).view(4, 8, 4)
        assert torch.equal(recurrent, a.states[0][1][block_a].view(torch.int32).transpose(1, 2))  # [HV, K, V]

        outcome, plan = b.resume("r1", ATTN_B, STATE_B)
        block_b = STATE_B[4 * C // N - 1]
        assert outcome.is_complete and plan.loads[0].state_blocks == (block_b,) * 2
        for (conv_b, ssm_b), (conv_a, ssm_a) in zip(state_bits(b, block_b), state_bits(a, block_a)):
            assert torch.equal(ssm_b, ssm_a) and torch.equal(conv_b, conv_a)  # bytes equal, NaN payloads too
        assert torch.equal(b.tokens(0, 4 * C, ATTN_B), a.tokens(0, 4 * C, ATTN_A))
        assert b.worker.counters.loaded_states == 1 and a.worker.counters.stored_states == 2
    finally:
        a.close(), b.close()


def test_a_bad_checkpoint_fails_the_whole_load_and_leaves_the_pool(pool, compute):
    a, b = HybridReplica(pool, "A", 1), HybridReplica(pool, "B", 2)
    try:
        a.prefill("r", ATTN_A, STATE_A)
        header, _ = checkpoint(pool, 4)
        with PoolClient(pool, name="vandal") as client:
            bytes_ = client.page(header.offset, header.page_bytes)
            bytes_[:8] = 255 - bytes_[:8]
        outcome, _ = b.resume("r1", ATTN_B, STATE_B)
        assert outcome.loaded_end == outcome.token_start and "GDN checkpoint" in outcome.reason
        assert b.worker.counters.checksum_failures == 1 and b.worker.counters.loaded_states == 0
        offered, _ = b.plan_resume("r2", ATTN_B, STATE_B)
        assert offered == 2 * C  # dropped: the next lookup resumes from the one before
    finally:
        a.close(), b.close()


def test_vllms_stream_waits_for_the_state_before_a_forward_reads_it(pool, compute):
    """A load that a step's forward reads (not beside the steps): the first layer is a GDN layer, never waited for
    per layer, so vLLM's stream waits for the state as the load starts; a load of KV alone adds no such wait."""
    a, b = HybridReplica(pool, "A", 1), HybridReplica(pool, "B", 2)
    try:
        a.prefill("r", ATTN_A, STATE_A)
        _, plan = b.plan_resume("r1", ATTN_B, STATE_B)
        for spec, state_waits in ((plan.loads[0], 1), (dataclasses.replace(plan.loads[0], state_page=None), 0)):
            waits = compute.waits
            loads = b.worker.start_loads([spec], per_layer=True)
            assert compute.waits == waits + state_waits  # the attention layers' waits come with wait_layer
            for index in range(LAYOUT.num_layers):
                loads.wait_layer(index)
            outcomes, all_waited = loads.finish()
            assert all_waited and outcomes[0].is_complete
        assert np.array_equal(state_bits(b, STATE_B[7])[1][1].numpy(), state_bits(a, STATE_A[7])[1][1].numpy())
    finally:
        a.close(), b.close()
