"""The connector's leases and reservations across a pool that dies, restarts or stops answering, and across the
reconnects of its link (vLLM-shaped CPU tensors, a real pool, no vLLM needed).

A hold taken from one pool is never ended, nor settled, in another; a lease outlives a dropped connection of a
live process, so a copy still to run reads the bytes that were committed.
"""

import os
import signal

import torch

from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.keys import chunk_keys, namespace_digest
from kvshare.pool.client import PoolClient
from kvshare.pool.link import PoolLink
from kvshare.pool.spawn import start_pool, stop_process
from tests.integrations.vllm.pool_replicas import (  # noqa: F401 (pool_fixture: the fixture ``pool``)
    BLOCKS_A,
    BLOCKS_B,
    LAYOUT,
    NAMESPACE,
    POOL_ARGS,
    PROMPT,
    C,
    FakeClock,
    N,
    Replica,
    plan_load_of_a_prefill,
    pool_fixture,
    pool_stats,
)
from tests.integrations.vllm.servers import private_socket


def test_pool_killed_keeps_serving_cold_and_leased_pages_still_load():
    with private_socket("kvshare-test") as path:
        proc = start_pool(path, "16MiB", POOL_ARGS)
        a, b = Replica(path, "A", seed=1), Replica(path, "B", seed=2)
        try:
            plan = plan_load_of_a_prefill(a, b)
            b.worker.link.client()  # the worker is connected before the pool dies
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            outcome = b.worker.load(plan.loads[0])  # the arena stays mapped: verified bytes still load
            assert outcome.is_complete
            assert torch.equal(b.tokens(0, 256, BLOCKS_B), a.tokens(0, 256, BLOCKS_A))
            for spec in plan.stores:
                assert b.worker.store(spec) == 0
            # with the pool gone, lookups answer 0 at once and nothing raises
            a.scheduler.add_request("r3", PROMPT, None, None)
            assert a.scheduler.match("r3", 0) == 0
            assert a.scheduler.match("r3", 0) == 0
            assert a.scheduler.counters.pool_errors + b.worker.counters.pool_errors >= 1
        finally:
            a.close(), b.close()
            stop_process(proc)


def test_lease_from_another_pool_is_refused():
    with private_socket("kvshare-test") as path:
        proc = start_pool(path, "16MiB", POOL_ARGS)
        a, b = Replica(path, "A", seed=1), Replica(path, "B", seed=2)
        try:
            plan = plan_load_of_a_prefill(a, b)
            stop_process(proc)  # the pool restarts between the lookup and the load
            proc = start_pool(path, "16MiB", POOL_ARGS)
            outcome = b.worker.load(plan.loads[0])
            assert outcome.loaded_end == 0 and "lease lost" in outcome.reason
        finally:
            a.close(), b.close()
            stop_process(proc)


def test_a_scheduler_lookup_that_times_out_keeps_the_leases_of_loads_still_to_run(pool):
    """The scheduler's link times out on one lookup (the pool stopped past its timeout, as a lookup that
    promotes from the remote tier can take longer than pool_timeout_s) while another request's lease waits
    for the worker's copy. The lease must survive the dropped connection: under eviction pressure its pages
    keep the bytes A committed, B loads exactly those, and the reconnected link releases the lease.
    Fails when a closed connection ends its holder's holds (holders.Process.is_gone always True): the pages
    are evicted and rewritten before B's worker copies them."""
    import signal

    from kvshare.pool.checksum import page_checksum

    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        b.scheduler.add_request("r2", PROMPT, None, None)
        assert b.scheduler.match("r2", 0) == 256  # leased, the worker has not copied yet
        link = b.scheduler.link
        link.client().timeout_s = 0.3
        if link.current.is_direct:  # as on a pool with a remote tier: a lookup that misses goes to the pool
            link.current._direct.answers_misses = False
        pool_pid = link.current.hello.server_pid
        os.kill(pool_pid, signal.SIGSTOP)
        try:
            b.scheduler.add_request("r3", list(range(5000, 5300)), None, None)
            assert b.scheduler.match("r3", 0) == 0  # timed out: served cold
        finally:
            os.kill(pool_pid, signal.SIGCONT)
        assert not link.current
        with PoolClient(pool, name="pressure") as writer:  # every page nobody holds is evicted and rewritten
            for round_ in range(8):
                keys = [bytes([round_, i]) * 8 for i in range(32)]
                reserved = writer.reserve(b"p" * 16, keys, LAYOUT.page_bytes)
                for _, offset in reserved.grants:
                    writer.page(offset, LAYOUT.page_bytes)[:] = 0xEE
                writer.commit(
                    reserved.reservation_id,
                    [page_checksum(writer.page(o, LAYOUT.page_bytes)) for _, o in reserved.grants],
                )
        b.clock.now += 1.0  # the link's retry is due (within the lease TTL)
        b.scheduler.allocated("r2", 256, 0)
        plan = b.scheduler.plan_step([ScheduledRequest("r2", 0, len(PROMPT), BLOCKS_B)])
        outcomes = b.load(plan.loads)
        b.scheduler.on_report(WorkerReport(outcomes))
        assert outcomes[0].is_complete
        assert torch.equal(b.tokens(0, 256, BLOCKS_B), a.tokens(0, 256, BLOCKS_A))  # bytes loaded == stored
        assert pool_stats(pool)["leases"] == 0  # released through the reconnected link
    finally:
        a.close()
        b.close()


def test_a_lease_of_an_earlier_pool_released_while_the_link_is_down_never_ends_a_lease_of_this_pool(pool):
    """A lease granted by a pool that is gone (another pool id) is released while the link is down. Lease
    ids restart in every pool, so the same id may name a lease this holder took from the pool it reconnects
    to, whose copy still runs: that lease must stay.
    Fails when the scheduler files the release under the link's last pool instead of the lease's own."""
    from kvshare.integrations.vllm.leases import HeldLease

    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        link = b.scheduler.link
        live = link.client().lookup(chunk_keys(namespace_digest(NAMESPACE), PROMPT, C), LAYOUT.page_bytes)
        assert live.lease_id and pool_stats(pool)["leases"] == 1
        stale = HeldLease(live.lease_id, 0, [], [], b.clock.now, (bytes(16), link.holder))
        link.failed(TimeoutError("the pool did not answer"))
        b.scheduler._release(stale)
        b.clock.now += 1.0  # the link's retry is due
        assert link.client() is not None
        assert pool_stats(pool)["leases"] == 1  # the live lease of the same id is kept
    finally:
        a.close()
        b.close()


def test_a_tensor_parallel_store_reserved_in_an_earlier_pool_never_commits_a_reservation_of_this_pool():
    """The scheduler reserves pages for a tensor parallel store; the pool restarts; the link reconnects and
    reserves again, in the new pool, under the same reservation id (ids restart in every pool). The ranks'
    parts of the first store then arrive: they must not commit the second reservation, whose pages no rank
    has written yet.
    Fails when the scheduler settles a store on whatever pool its link is connected to now."""
    from kvshare.integrations.vllm.metadata import StorePart, StoreSpec

    keys = tuple(chunk_keys(namespace_digest(NAMESPACE), PROMPT, C))
    digest = namespace_digest(NAMESPACE)
    with private_socket("kvshare-test") as path:
        proc = start_pool(path, "16MiB", POOL_ARGS)
        clock = FakeClock()
        config = ConnectorConfig(pool_socket=path, chunk_tokens=C, replica="tp")
        scheduler = PoolScheduler(
            config, NAMESPACE, LAYOUT.page_bytes, N, PoolLink(path, "tp-sched", clock=clock), clock=clock, tp_size=2
        )
        try:
            first = scheduler._parted.reserve(StoreSpec("r1", digest, 0, keys, (0,)))
            stop_process(proc)
            proc = start_pool(path, "16MiB", POOL_ARGS)
            assert scheduler.link.reconnect_now() is not None
            second = scheduler._parted.reserve(StoreSpec("r2", digest, 0, keys, (0,)))
            assert second.reservation_id == first.reservation_id and second.pool_id != first.pool_id
            assert pool_stats(path)["reservations"] == 1
            for rank in range(2):
                part = StorePart(first.reservation_id, first.pool_id, rank, True, (1,) * len(first.grants))
                scheduler._parted.add_part(part)
            assert pool_stats(path)["reservations"] == 1  # the new pool's reservation still waits for its parts
        finally:
            scheduler.close()
            stop_process(proc)
