"""The connector's two sides against a real pool, with vLLM-shaped CPU tensors (no vLLM needed): the round trip.

Replica A computes a prompt (stores), replica B loads it into other blocks: the bytes B
holds afterwards must be the bytes A computed, and only where the load was planned.
"""

import random

import pytest
import torch

from kvshare.integrations.vllm.scheduler import ScheduledRequest
from kvshare.keys import namespace_digest
from tests.integrations.vllm.pool_replicas import (  # noqa: F401 (pool_fixture: the fixture ``pool``)
    BLOCKS_A,
    BLOCKS_B,
    LAYERED,
    LAYOUT,
    NAMESPACE,
    NUM_BLOCKS,
    PROMPT,
    C,
    N,
    Replica,
    flip_a_byte_of_chunk_2,
    pool_fixture,
    pool_stats,
)
from tests.verdicts import spy_verdicts


@LAYERED
def test_cross_replica_bytes_equal(pool, layered):
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, layered=layered)
    try:
        external, _ = a.run_prefill("r1", PROMPT, BLOCKS_A)
        assert external == 0
        assert pool_stats(pool)["entries"] == 4
        assert a.worker.counters.stored_chunks == 4

        external, outcome = b.run_prefill("r2", PROMPT, BLOCKS_B)
        assert external == 256 and outcome.is_complete and b.num_layered == int(layered)
        assert torch.equal(b.tokens(0, 256, BLOCKS_B), a.tokens(0, 256, BLOCKS_A))  # bytes loaded == bytes stored
        assert not torch.equal(b.tokens(256, 44, BLOCKS_B), a.tokens(256, 44, BLOCKS_A))  # the tail was not loaded
        assert pool_stats(pool)["leases"] == 0  # released once the step that loaded reported
        assert b.scheduler.finish("r2") == {
            "replica": "B",
            "local_tokens": 0,
            "pool_tokens": 256,
            "computed_tokens": 44,
            "namespace": namespace_digest(NAMESPACE).hex(),
        }
        assert b.worker.counters.stored_chunks == 0  # nothing new to store
    finally:
        a.close(), b.close()


def test_chunked_prefill_stores_every_chunk_once(pool):
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A, step_tokens=100)  # steps end at 100, 200, 300
        assert a.worker.counters.stored_chunks == 4
        _, outcome = b.run_prefill("r2", PROMPT, BLOCKS_B)
        assert outcome.is_complete
        assert torch.equal(b.tokens(0, 256, BLOCKS_B), a.tokens(0, 256, BLOCKS_A))
    finally:
        a.close(), b.close()


@LAYERED
def test_unaligned_local_hit_loads_only_the_rest(pool, layered):
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, layered=layered)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        before = b.tokens(0, 96, BLOCKS_B).clone()
        external, outcome = b.run_prefill("r2", PROMPT, BLOCKS_B, local=96)  # 3 blocks: inside chunk 1
        assert external == 256 - 96 and outcome.token_start == 96
        assert torch.equal(b.tokens(0, 96, BLOCKS_B), before)  # the local hit is left alone
        assert torch.equal(b.tokens(96, 160, BLOCKS_B), a.tokens(96, 160, BLOCKS_A))
        assert b.scheduler.finish("r2")["local_tokens"] == 96
    finally:
        a.close(), b.close()


@LAYERED
def test_a_load_that_starts_inside_a_block_takes_the_token_path(pool, layered):
    """vLLM's local hits are whole blocks; should one not be, its first page goes token by token
    (scatter_tokens) and the rest as whole blocks: the bytes are the same either way."""
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, layered=layered)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        before = b.tokens(0, 40, BLOCKS_B).clone()
        external, outcome = b.run_prefill("r2", PROMPT, BLOCKS_B, local=40)
        assert external == 256 - 40 and outcome.is_complete
        assert torch.equal(b.tokens(0, 40, BLOCKS_B), before)
        assert torch.equal(b.tokens(40, 216, BLOCKS_B), a.tokens(40, 216, BLOCKS_A))
    finally:
        a.close(), b.close()


@LAYERED
def test_a_prompt_of_whole_chunks_leaves_its_last_block(pool, layered):
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, layered=layered)
    try:
        a.run_prefill("r1", PROMPT[:256], BLOCKS_A)
        external, outcome = b.run_prefill("r2", PROMPT[:256], BLOCKS_B)
        assert external == 256 - N and outcome.loaded_end == 256 - N  # whole blocks, the last one computed
        assert torch.equal(b.tokens(0, 256 - N, BLOCKS_B), a.tokens(0, 256 - N, BLOCKS_A))
    finally:
        a.close(), b.close()


@LAYERED
def test_corrupted_page_stops_the_load_and_is_dropped(pool, layered):
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, verify_fraction=1.0, layered=layered)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        flip_a_byte_of_chunk_2(pool)
        external, outcome = b.run_prefill("r2", PROMPT, BLOCKS_B)
        assert external == 256 and b.num_layered == int(layered)
        assert outcome.loaded_end == 2 * C and "checksum" in outcome.reason
        assert b.worker.counters.verified_pages == 3
        assert b.worker.counters.checksum_failures == 1 and b.worker.counters.load_failures == 1
        assert torch.equal(b.tokens(0, 128, BLOCKS_B), a.tokens(0, 128, BLOCKS_A))  # what was loaded is right
        stats = pool_stats(pool)
        assert stats["dropped_pages"] == 1 and stats["leases"] == 0
        assert b.scheduler.finish("r2")["pool_tokens"] == 128
    finally:
        a.close(), b.close()


@LAYERED
def test_without_verification_the_corrupted_byte_would_be_served(pool, layered):
    """Negative control for the test above: the checksum is what stops the flipped byte."""
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, verify_fraction=0.0, layered=layered)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        flip_a_byte_of_chunk_2(pool)
        _, outcome = b.run_prefill("r2", PROMPT, BLOCKS_B)
        assert outcome.is_complete  # nothing noticed ...
        assert not torch.equal(b.tokens(0, 256, BLOCKS_B), a.tokens(0, 256, BLOCKS_A))  # ... and the KV is wrong
    finally:
        a.close(), b.close()


@LAYERED
@pytest.mark.parametrize("forced", [None, True], ids=["checked", "forced-valid"])
def test_each_load_refuses_a_corrupt_page_through_the_one_check(pool, monkeypatch, layered, forced):
    """The synchronous load and the layered CPU load ask kvshare.pool.checksum whether a page is valid.

    Fails when either compares checksums itself: forced valid, it would still stop at the bad page.
    """
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, verify_fraction=1.0, layered=layered)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        flip_a_byte_of_chunk_2(pool)
        calls = spy_verdicts(monkeypatch, forced)
        _, outcome = b.run_prefill("r2", PROMPT, BLOCKS_B)
        assert b.num_layered == int(layered)
        assert outcome.is_complete == bool(forced) and (forced or outcome.loaded_end == 2 * C)
        assert len(calls) >= 3  # pages 0, 1 and the bad 2 at least
    finally:
        a.close(), b.close()


class FixedDraw:
    """An rng whose every draw is ``value``: at ``verify_fraction`` 0.5, PageSampler then checks the even pages
    of a load (0.0: its credit of 0.5 exceeds every draw) or the odd ones (0.99: only a credit of 1 does)."""

    def __init__(self, value):
        self.value = value

    def random(self):
        return self.value


@pytest.mark.parametrize("draw,is_detected", [(0.0, True), (0.99, False)])
@LAYERED
def test_sampled_verification_checks_the_pages_it_draws(pool, draw, is_detected, layered):
    a, b = (
        Replica(pool, "A", seed=1),
        Replica(pool, "B", seed=2, rng=FixedDraw(draw), verify_fraction=0.5, layered=layered),
    )
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        flip_a_byte_of_chunk_2(pool)
        _, outcome = b.run_prefill("r2", PROMPT, BLOCKS_B)
        assert (outcome.loaded_end == 2 * C) == is_detected and outcome.is_complete != is_detected
        assert b.worker.counters.verified_pages == 2  # half the pages: 0 and the bad 2, or 1 and 3
        assert b.worker.counters.checksum_failures == int(is_detected)
    finally:
        a.close(), b.close()


def test_sampled_verification_checks_a_share_of_the_pages(pool):
    a = Replica(pool, "A", seed=1)
    b = Replica(pool, "B", seed=2, rng=random.Random(7), verify_fraction=0.5)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        for i in range(10):  # 40 pages loaded
            _, outcome = b.run_prefill(f"r{i + 2}", PROMPT, BLOCKS_B)
            assert outcome.is_complete
            b.scheduler.finish(f"r{i + 2}")
        assert 10 <= b.worker.counters.verified_pages <= 30
        assert torch.equal(b.tokens(0, 256, BLOCKS_B), a.tokens(0, 256, BLOCKS_A))
    finally:
        a.close(), b.close()


@pytest.mark.parametrize("copy_threads", [1, 2])
@LAYERED
def test_any_block_table_gets_the_stored_bytes(pool, copy_threads, layered):
    """vLLM's block tables: ascending on a fresh server, descending and mixed runs on a busy one."""
    a = Replica(pool, "A", seed=1)
    b = Replica(pool, "B", seed=2, copy_threads=copy_threads, layered=layered)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        for i, table in enumerate(([5, 6, 30, 29, 28, 12, 13, 14, 2, 20], list(range(20, 30)), BLOCKS_B)):
            untouched = [blk for blk in range(NUM_BLOCKS) if blk not in table]
            before = [layer.view(NUM_BLOCKS, -1)[untouched].clone() for layer in b.layers]
            _, outcome = b.run_prefill(f"r{i + 2}", PROMPT, table)
            assert outcome.is_complete
            assert torch.equal(b.tokens(0, 256, table), a.tokens(0, 256, BLOCKS_A))  # bytes loaded == bytes stored
            assert all(
                torch.equal(layer.view(NUM_BLOCKS, -1)[untouched], kept) for layer, kept in zip(b.layers, before)
            )
            b.scheduler.finish(f"r{i + 2}")
    finally:
        a.close(), b.close()


def test_leases_are_idempotent_per_request_and_expire(pool):
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        sched = b.scheduler
        sched.add_request("r2", PROMPT, None, None)
        assert sched.match("r2", 0) == 256
        assert sched.match("r2", 0) == 256  # asked again (vLLM could not allocate yet)
        assert pool_stats(pool)["leases"] == 1 and sched.counters.lookups == 1
        b.clock.now += 3600  # never scheduled: the lease expires in the connector
        sched.plan_step([])
        assert pool_stats(pool)["leases"] == 0 and sched.counters.expired_leases == 1
        assert sched.match("r2", 0) == 256  # a fresh lookup
        sched.finish("r2")  # finished (aborted) before it was scheduled: released
        assert pool_stats(pool)["leases"] == 0
    finally:
        a.close(), b.close()


def test_use_pool_false_neither_loads_nor_stores(pool):
    a = Replica(pool, "A", seed=1)
    try:
        a.scheduler.add_request("r1", PROMPT, None, {"kvshare": {"use_pool": False}})
        assert a.scheduler.match("r1", 0) == 0
        plan = a.scheduler.plan_step([ScheduledRequest("r1", 0, 300, BLOCKS_A)])
        assert plan.loads == () and plan.stores == ()
        assert pool_stats(pool)["lookups"] == 0
    finally:
        a.close()


def test_tenants_loras_and_multimodal_prompts_do_not_share(pool):
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)  # no cache_salt, no LoRA
        b.scheduler.add_request("r2", PROMPT, "tenant-2", None)
        assert b.scheduler.match("r2", 0) == 0
        b.scheduler.add_request("r3", PROMPT, None, None, lora_id="adapter-1")
        assert b.scheduler.match("r3", 0) == 0
        b.scheduler.add_request("r4", PROMPT, None, None, is_text_only=False)  # image placeholders
        assert b.scheduler.match("r4", 0) == 0 and not b.scheduler.uses_pool("r4")
        b.scheduler.add_request("r5", PROMPT, None, None)
        assert b.scheduler.match("r5", 0) == 256  # the control: same scope, shared
    finally:
        a.close(), b.close()
