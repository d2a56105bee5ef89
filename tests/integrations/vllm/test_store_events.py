"""The connector's stores reach the pool's KV events as a foreign indexer needs them (no vLLM needed).

A vLLM replica that loaded a prefix (or found it in its own prefix cache) stores only the chunks it computed: a
run that starts in the middle of its chain. The pool announces a page only after its parent (llm-d drops an
event whose parent it has not seen) and with its token ids (an indexer rehashes them), so the run must name
the chunk before it and carry its tokens; a tenant's chunks carry none.
"""

import time

import pytest

from kvshare.integrations.vllm.scheduler import ScheduledRequest
from kvshare.pool.spawn import running_pool
from tests.integrations.vllm.pool_replicas import BLOCKS_A, BLOCKS_B, POOL_ARGS, PROMPT, C, Replica

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")
from tests.pool.test_events_wire import BlockStored, Subscriber  # noqa: E402

LONGER = PROMPT + list(range(1000, 1220))  # 520 tokens: chunks 0..3 as PROMPT's, 4..7 new


def events_of(sub, num_stored: int, timeout_s: float = 20.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sum(isinstance(e, BlockStored) for e in sub.events) < num_stored:
        sub.poll(100)
    return [e for e in sub.events if isinstance(e, BlockStored)]


@pytest.mark.timeout(120)
def test_a_replica_that_loaded_a_prefix_announces_the_chunks_it_computed_after_it(tmp_path):
    """Fails when the connector reserves its run without its parent and tokens: B's chunks 4..7 are then never
    announced (their first page names no parent), or announced without token ids."""
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    args = (*POOL_ARGS, "--kv-events", endpoint, "--kv-events-replay", replay, "--kv-events-topic", "kv@b@tiny")
    with running_pool("16MiB", args, quiet=True) as path:
        a, b = Replica(path, "a", seed=1), Replica(path, "b", seed=2)
        sub = Subscriber(endpoint, replay, "kv@b@tiny")
        try:
            a.run_prefill("r1", PROMPT, BLOCKS_A)  # chunks 0..3
            external, outcome = b.run_prefill("r2", LONGER, BLOCKS_B + list(range(10, 16)))
            assert external == 4 * C and outcome.is_complete  # B loaded A's four chunks, computed the rest
            stored = events_of(sub, 8)
        finally:
            sub.close(), a.close(), b.close()
    assert len(stored) == 8  # each page once, parent first
    chain = [e.block_hashes[0] for e in stored]
    assert [e.parent_block_hash for e in stored] == [None, *chain[:-1]]
    assert [e.token_ids for e in stored] == [LONGER[i * C : (i + 1) * C] for i in range(8)]


@pytest.mark.timeout(120)
def test_a_tenants_chunks_are_announced_without_token_ids(tmp_path):
    """A salted request's keys cannot be rehashed from its tokens: its pages carry none (an indexer keyed by
    tokens must not match another tenant's pages)."""
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    args = (*POOL_ARGS, "--kv-events", endpoint, "--kv-events-replay", replay, "--kv-events-topic", "kv@a@tiny")
    with running_pool("16MiB", args, quiet=True) as path:
        a = Replica(path, "a", seed=1)
        sub = Subscriber(endpoint, replay, "kv@a@tiny")
        try:
            a.scheduler.add_request("t", PROMPT, "tenant-salt", None)
            a.scheduler.allocated("t", a.scheduler.match("t", 0), 0)
            plan = a.scheduler.plan_step([ScheduledRequest("t", 0, len(PROMPT), BLOCKS_A)])
            assert plan.stores and all(spec.token_ids is None for spec in plan.stores)
            for spec in plan.stores:
                a.worker.store(spec)
            stored = events_of(sub, 4)
        finally:
            sub.close(), a.close()
    assert len(stored) == 4 and all(e.token_ids == [] for e in stored)
