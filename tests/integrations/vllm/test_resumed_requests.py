"""A request resumed after a preemption, on the connector's two sides against a real pool (no vLLM needed).

vLLM frees a preempted request's blocks and asks the connector again when it resumes: by then the request's
own blocks may still sit in vLLM's prefix cache, or its chunks (stored by its first prefill) in the pool.
Its provenance keeps describing its first prefill, as vLLM's ``cached_tokens`` does.
"""

from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.scheduler import ScheduledRequest
from tests.integrations.vllm.pool_replicas import (  # noqa: F401 (pool_fixture: the fixture ``pool``)
    BLOCKS_A,
    BLOCKS_B,
    PROMPT,
    Replica,
    pool_fixture,
    pool_stats,
)


def resume(replica: Replica, req_id: str, num_cached: int, block_ids: list[int]) -> int:
    """The request back from preemption: vLLM's own cache holds ``num_cached`` of its tokens, it has no
    prefill stats any more (taken with its first token), and it prefills the rest in one step."""
    sched = replica.scheduler
    external = sched.match(req_id, num_cached)
    sched.allocated(req_id, external, None)
    computed = num_cached + external
    plan = sched.plan_step([ScheduledRequest(req_id, computed, len(PROMPT) - computed, block_ids)])
    sched.on_report(WorkerReport(replica.load(plan.loads)))
    return external


def test_a_pool_load_resumed_on_its_own_cached_blocks_keeps_its_provenance(pool):
    """Fails when a resume's match overwrites local_tokens: the provenance then said 288 local tokens and 12
    from the pool for a prompt whose 256 first tokens came from the pool."""
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        external, _ = b.run_prefill("r2", PROMPT, BLOCKS_B)
        assert external == 256
        assert resume(b, "r2", 288, BLOCKS_B) == 0  # its own blocks, loaded and computed, still cached
        origin = b.scheduler.finish("r2")
        assert (origin["local_tokens"], origin["pool_tokens"], origin["computed_tokens"]) == (0, 256, 44)
        assert pool_stats(pool)["leases"] == 0
    finally:
        a.close(), b.close()


def test_a_cold_prefill_resumed_from_its_own_stored_chunks_keeps_its_provenance(pool):
    """Fails when the resume's load is added to pool_tokens: the provenance then said 256 pool tokens for a
    prompt its first prefill computed whole. The load itself happens and is counted."""
    a = Replica(pool, "A", seed=1)
    try:
        assert a.run_prefill("r1", PROMPT, BLOCKS_A)[0] == 0  # cold: computed and stored
        assert resume(a, "r1", 0, BLOCKS_A) == 256  # its blocks evicted meanwhile: its chunks come from the pool
        assert a.scheduler.counters.hit_tokens == 256 and a.worker.counters.loaded_tokens == 256
        origin = a.scheduler.finish("r1")
        assert (origin["local_tokens"], origin["pool_tokens"], origin["computed_tokens"]) == (0, 0, 300)
        assert pool_stats(pool)["leases"] == 0
    finally:
        a.close()
