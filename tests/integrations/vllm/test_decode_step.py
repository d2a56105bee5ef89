"""A decode step costs the connector no pool round trip and no thread work (no vLLM needed).

Most of a replica's steps decode: a request whose prompt is computed and stored schedules one token a step,
and the connector has nothing to load or store. Its hooks then must not reach the pool, hand work to its
copy or hash threads, or take the pool client's lock: each of those waits on another thread or process, on
every step. Counted, not timed, on both the scheduler side (build_connector_meta's plan, the worker's
report) and the worker side (vLLM's hooks in their order, CPU and layered loads).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.scheduler import ScheduledRequest
from kvshare.integrations.vllm.worker import WorkerHooks
from kvshare.pool.client import PoolClient
from tests.integrations.vllm.pool_replicas import BLOCKS_A, LAYERED, PROMPT, Replica, pool_fixture  # noqa: F401

DECODE_STEPS = 8


class Counts:
    """Messages sent to the pool, tasks handed to a thread pool and pool-client lock acquisitions."""

    def __init__(self, monkeypatch) -> None:
        self.sent = self.submitted = self.locked = 0
        send, submit, call = PoolClient._send, ThreadPoolExecutor.submit, PoolClient._call

        def counted_send(client, data):
            self.sent += 1
            return send(client, data)

        def counted_submit(executor, *args, **kwargs):
            self.submitted += 1
            return submit(executor, *args, **kwargs)

        def counted_call(client, request):
            self.locked += 1  # _call holds the client's lock for the round trip
            return call(client, request)

        monkeypatch.setattr(PoolClient, "_send", counted_send)
        monkeypatch.setattr(ThreadPoolExecutor, "submit", counted_submit)
        monkeypatch.setattr(PoolClient, "_call", counted_call)

    def total(self) -> tuple[int, int, int]:
        return self.sent, self.submitted, self.locked


def decode_step(replica: Replica, hooks: WorkerHooks, req_id: str, computed: int) -> None:
    """One decode step of ``req_id`` in vLLM's hook order: plan, load, the forward's layers, save, report."""
    s = replica.scheduler
    plan = s.plan_step([ScheduledRequest(req_id, computed, 1, BLOCKS_A)])
    assert not plan.loads and not plan.stores
    hooks.start_load(plan)
    for index in range(len(replica.layers)):
        hooks.wait_layer(index)
        hooks.save_layer(index, plan)
    hooks.wait_for_save(plan)
    assert not hooks.load_errors()
    report = WorkerReport(hooks.take_outcomes(), hooks.take_store_parts())
    assert not report.loads and not report.stores  # build_connector_worker_meta then sends vLLM nothing
    s.on_report(report)


@LAYERED
def test_a_decode_step_does_no_pool_round_trip_and_no_thread_work(pool, monkeypatch, layered):  # noqa: F811
    """Fails when a step with nothing to load or store sends the pool a message, submits to a thread pool or
    takes the pool client's lock (checked by adding a ``client.stats()`` to plan_step: 8 messages)."""
    a = Replica(pool, "a", seed=1, layered=layered, overlap_load=layered)
    b = Replica(pool, "b", seed=2, layered=layered, overlap_load=layered)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)  # stored
        hooks = WorkerHooks(b.worker, 32)  # the worker copies beside the forward when ``layered``
        s = b.scheduler
        s.add_request("r2", PROMPT, None, None)
        external = s.match("r2", 0)
        s.allocated("r2", external, 0)
        plan = s.plan_step([ScheduledRequest("r2", external, len(PROMPT) - external, BLOCKS_A)])
        assert plan.loads  # B loads A's chunks: the worker has connected and its threads exist
        hooks.start_load(plan)
        for index in range(len(b.layers)):
            hooks.wait_layer(index)
        hooks.wait_for_save(plan)
        s.on_report(WorkerReport(hooks.take_outcomes()))
        counts = Counts(monkeypatch)
        for step in range(DECODE_STEPS):
            decode_step(b, hooks, "r2", len(PROMPT) + step)
        assert counts.total() == (0, 0, 0)
    finally:
        a.close()
        b.close()


def test_the_counts_see_a_round_trip_and_thread_work(pool, monkeypatch):  # noqa: F811
    """The counters themselves: a stats call and a submitted task are seen."""
    counts = Counts(monkeypatch)
    with PoolClient(pool, name="counted") as client:
        client.stats()
    with ThreadPoolExecutor(1) as executor:
        executor.submit(int).result()
    assert counts.sent >= 1 and counts.locked >= 1 and counts.submitted == 1
