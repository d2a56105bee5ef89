"""Loads copied layer by layer beside the forward (kvshare.integrations.vllm.cpu_overlap), no vLLM needed.

The byte-for-byte cases (cross-replica, corrupted page, block tables, sampled verification) run
in both modes in test_pool_roundtrip.py; here: what only the layered mode has.
"""

import time

import numpy as np
import pytest
import torch
import xxhash

from kvshare.integrations.vllm.cpu_overlap import LayeredLoads
from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.scheduler import ScheduledRequest
from kvshare.pool.checksum import page_checksum
from tests.integrations.vllm.pool_replicas import (  # noqa: F401
    BLOCKS_A,
    BLOCKS_B,
    PROMPT,
    Replica,
    flip_a_byte_of_chunk_2,
    pool_fixture,
)

LAYERS = 2


def planned_load(a, b, req_id="r2"):
    """A computed and stored PROMPT; B's load of the first 256 tokens (a LoadSpec)."""
    a.run_prefill("r1", PROMPT, BLOCKS_A)
    b.scheduler.add_request(req_id, PROMPT, None, None)
    external = b.scheduler.match(req_id, 0)
    b.scheduler.allocated(req_id, external, 0)
    return b.scheduler.plan_step([ScheduledRequest(req_id, 0, len(PROMPT), BLOCKS_B)]).loads[0]


def start_beside(replica, specs):
    """Start the loads copied beside the forward; whole blocks: the layered path takes every one."""
    loads = replica.worker.start_loads(list(specs), per_layer=True)
    assert isinstance(loads, LayeredLoads) and len(loads.loads) == len(specs) and not loads.settled
    assert all(load.runs for load in loads.loads)
    return loads


def layer_tokens(replica, index, block_ids):
    return replica.tokens(0, 256, block_ids)[index]


def slow_copies(worker, seconds):
    """Each layer's copy starts ``seconds`` late, as on a busy machine."""
    copy = worker.copier.layer_to_blocks

    def late(*args):
        time.sleep(seconds)
        copy(*args)

    worker.copier.layer_to_blocks = late


def test_each_layer_is_in_place_when_its_wait_returns(pool):  # noqa: F811
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, layered=True)
    try:
        load = planned_load(a, b)
        slow_copies(b.worker, 0.1)
        loads = start_beside(b, [load])
        # control: without a wait the forward would read the old bytes (the copies are still sleeping)
        assert not torch.equal(layer_tokens(b, LAYERS - 1, BLOCKS_B), layer_tokens(a, LAYERS - 1, BLOCKS_A))
        for index in range(LAYERS):
            loads.wait_layer(index)
            assert torch.equal(layer_tokens(b, index, BLOCKS_B), layer_tokens(a, index, BLOCKS_A))
        (outcome,), all_waited = loads.finish()
        assert all_waited and outcome.is_complete and outcome.loaded_end == 256
        assert b.worker.counters.verified_pages == 4 and b.worker.counters.checksum_failures == 0
        b.scheduler.on_report(WorkerReport([outcome]))
    finally:
        a.close(), b.close()


def test_a_layer_never_waited_for_fails_the_load(pool):  # noqa: F811
    """The forward may have read blocks before their copy: nothing of the load may count."""
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, layered=True)
    try:
        loads = start_beside(b, [planned_load(a, b)])
        loads.wait_layer(0)  # layer 1's attention never called wait_for_layer_load
        (outcome,), all_waited = loads.finish()
        assert not all_waited
        assert outcome.loaded_end == 0 and "never waited for layers [1]" in outcome.reason
        assert b.worker.counters.load_failures == 1
    finally:
        a.close(), b.close()


def test_a_copy_that_raises_fails_the_load_and_no_wait_hangs(pool):  # noqa: F811
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, layered=True)
    try:
        load = planned_load(a, b)

        def broken(*args):
            raise MemoryError("no room")

        b.worker.copier.layer_to_blocks = broken
        loads = start_beside(b, [load])
        for index in range(LAYERS):
            loads.wait_layer(index)  # returns: the helper marks every layer when it stops
        (outcome,), all_waited = loads.finish()
        assert all_waited and outcome.loaded_end == 0 and "MemoryError" in outcome.reason
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("num_layers", [1, 2, 36])
def test_a_page_checksum_streamed_layer_by_layer_is_the_page_checksum(num_layers):
    page = np.random.default_rng(num_layers).integers(0, 255, (num_layers, 2, 64, 2, 64), dtype=np.uint8)
    streamed = xxhash.xxh3_64()
    for index in range(num_layers):
        streamed.update(page[index])
    assert streamed.intdigest() == page_checksum(page)
    page[num_layers - 1, 1, 63, 1, 63] ^= 1  # negative control: the last byte counts
    assert streamed.intdigest() != page_checksum(page)


def test_two_loads_in_one_step_each_get_their_own_outcome(pool):  # noqa: F811
    """Layer-major copying interleaves the step's loads: a bad page in one must not touch the other's outcome."""
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, layered=True)
    other = [t + 1000 for t in PROMPT]  # another prompt, another chain of keys
    blocks_other = list(range(10, 20))
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        a.run_prefill("r9", other, list(range(20, 30)))
        flip_a_byte_of_chunk_2(pool)  # PROMPT's chunk 2
        steps = []
        for req_id, prompt, blocks in (("bad", PROMPT, BLOCKS_B), ("good", other, blocks_other)):
            b.scheduler.add_request(req_id, prompt, None, None)
            external = b.scheduler.match(req_id, 0)
            b.scheduler.allocated(req_id, external, 0)
            steps.append(ScheduledRequest(req_id, 0, len(prompt), blocks))
        plan = b.scheduler.plan_step(steps)
        assert len(plan.loads) == 2
        loads = start_beside(b, plan.loads)
        for index in range(LAYERS):
            loads.wait_layer(index)
        (bad, good), all_waited = loads.finish()
        assert all_waited
        assert bad.req_id == "bad" and bad.loaded_end == 128 and "checksum" in bad.reason
        assert good.req_id == "good" and good.is_complete and good.loaded_end == 256
        assert torch.equal(b.tokens(0, 256, blocks_other), a.tokens(0, 256, list(range(20, 30))))
        assert torch.equal(b.tokens(0, 128, BLOCKS_B), a.tokens(0, 128, BLOCKS_A))
        assert b.worker.counters.checksum_failures == 1 and b.worker.counters.verified_pages == 3 + 4
    finally:
        a.close(), b.close()


def test_a_copy_task_that_never_runs_fails_the_load_and_no_wait_hangs(pool):  # noqa: F811
    """A broken or shut-down executor: the waits return and the load fails instead of the forward hanging."""
    from concurrent.futures import Future

    class NeverRuns:
        def submit(self, fn):
            future = Future()
            future.cancel()
            return future

    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, layered=True)
    try:
        planned = start_beside(b, [planned_load(a, b)])  # the load's plan (its block runs), run once ...
        for index in range(LAYERS):
            planned.wait_layer(index)
        planned.finish()
        loads = LayeredLoads(b.worker, planned.loads, b.worker.copier, NeverRuns(), [])  # ... then never
        for index in range(LAYERS):
            loads.wait_layer(index)
        (outcome,), all_waited = loads.finish()
        assert all_waited and outcome.loaded_end == 0 and "CancelledError" in outcome.reason
    finally:
        a.close(), b.close()
