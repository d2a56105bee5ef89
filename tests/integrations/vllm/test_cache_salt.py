"""``--engine vllm``: the connector's scheduler salts pool keys with vLLM's request.cache_salt.

vLLM honours cache_salt in its own prefix cache; across replicas the pool must too. Two
connector sides over a real pool, no vLLM needed (tests/integrations/vllm/test_pool_roundtrip.py's
Replica): equal salts share chunks, different salts never do, no salt never reaches a salted
chunk and the reverse.
"""

from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.scheduler import ScheduledRequest
from kvshare.keys import namespace_digest
from tests.integrations.vllm.pool_replicas import BLOCKS_A, NAMESPACE, PROMPT, Replica, pool_fixture  # noqa: F401

OTHER_PROMPT = list(range(400, 700))
REUSABLE = 256  # PROMPT's four full chunks of 64 tokens


def prefill(replica: Replica, req_id: str, prompt: list[int], salt: str | None) -> int:
    """One request computed by ``replica`` and stored in the pool; the tokens it took from the pool."""
    s = replica.scheduler
    s.add_request(req_id, prompt, salt, None)
    external = s.match(req_id, 0)
    s.allocated(req_id, external, 0)
    plan = s.plan_step([ScheduledRequest(req_id, external, len(prompt) - external, BLOCKS_A)])
    outcomes = replica.load(plan.loads)
    for spec in plan.stores:
        replica.worker.store(spec)
    s.on_report(WorkerReport(outcomes))
    s.finish(req_id)
    return external


def matched(replica: Replica, req_id: str, prompt: list[int], salt: str | None) -> int:
    """Tokens the pool would supply to a new request (its lease released again)."""
    replica.scheduler.add_request(req_id, prompt, salt, None)
    try:
        return replica.scheduler.match(req_id, 0)
    finally:
        replica.scheduler.finish(req_id)


def test_equal_salts_share_pool_chunks_other_salts_and_no_salt_do_not(pool):  # noqa: F811
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2)
    try:
        assert prefill(a, "r1", PROMPT, "salt-1") == 0
        assert matched(b, "q1", PROMPT, "salt-2") == 0
        assert matched(b, "q2", PROMPT, None) == 0  # no salt never reaches a salted chunk
        assert matched(b, "q3", PROMPT, "salt-1") == REUSABLE  # the same salt does
        assert prefill(a, "r2", OTHER_PROMPT, None) == 0
        assert matched(b, "q4", OTHER_PROMPT, "salt-1") == 0  # the reverse: a salt never reaches unsalted chunks
        assert matched(b, "q5", OTHER_PROMPT, None) == REUSABLE
    finally:
        a.close(), b.close()


def test_the_salt_is_the_namespace_tenant_salt():
    digests = {namespace_digest(NAMESPACE.with_tenant(s)) for s in ("", "salt-1", "salt-2")}
    assert len(digests) == 3
