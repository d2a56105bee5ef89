"""Asynchronous loads: a load that runs beside vLLM's steps while vLLM parks its request (WAITING_FOR_REMOTE_KVS).

The connector's sides are driven in vLLM's order without vLLM (tests/integrations/vllm/staged_replica.py): on
CPU tensors through the CPU worker (its loader thread) and through the GPU worker under the fake CUDA (its
end event polled). The request is never scheduled while its load runs; another request's steps go on; the
load is reported by ``poll_async`` (get_finished), its bad blocks in the same pass (load_errors).
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvshare.integrations.vllm.metadata import LoadOutcome, WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.integrations.vllm.scheduler import PoolScheduler
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.link import PoolLink
from kvshare.pool.spawn import running_pool
from kvshare.transfer.base import TransferConfig
from tests.integrations.vllm.staged_replica import Replica, namespace_of
from tests.transfer import fake_cuda

N = 8
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
SMALL = TransferConfig(min_copy_bytes=4 << 10, staging_bytes=12 << 10)
PROMPT = list(range(7, 7 + 10 * 32 + 5))  # ten chunks and a tail
OTHER = list(range(1000, 1000 + 3 * 32 + 3))  # a prompt the pool does not hold
NUM_BLOCKS = 96
BLOCKS_A = list(range(0, 41))
BLOCKS_B = list(range(95, 54, -1))
BLOCKS_OTHER = list(range(41, 54))
DEVICES = pytest.mark.parametrize("staged", [False, True], ids=["cpu", "gpu-fake"])


@pytest.fixture(scope="module")
def pool():
    with running_pool("4MiB", ("--extent-size", "128KiB")) as socket_path:
        yield socket_path


@pytest.fixture
def flushed(pool, monkeypatch):
    fake_cuda.install(monkeypatch, fake_cuda.FakeCuda())
    monkeypatch.setattr(fake_cuda.FakeEvent, "is_pending", False)
    with PoolClient(pool, name="flush") as client:
        client.flush()
    return pool


def replica(socket_path, name, staged, **config):
    return Replica(
        socket_path,
        name,
        LAYOUT,
        "LBNHC" if staged else "cpu_attn",
        NUM_BLOCKS,
        N,
        torch.device("cpu"),
        staged=staged,
        worker_kwargs={"transfer": SMALL},
        **config,
    )


def start_async(b: Replica, req_id: str, prompt: list[int], block_ids: list[int]):
    """vLLM's order for a request whose load the connector runs asynchronously: matched, allocated, then a step
    that does not schedule it carries the load; the worker starts it and the step ends."""
    s = b.scheduler
    s.add_request(req_id, prompt, None, None)
    num_tokens = s.match(req_id, 0)
    assert num_tokens and s.is_async(req_id)
    s.allocated(req_id, num_tokens, 0, block_ids)
    plan = s.plan_step([])  # vLLM parks the request: no step schedules it
    assert [spec.is_async for spec in plan.loads] == [True]
    b.hooks.start_load(plan)
    b.hooks.wait_for_save(plan)
    return num_tokens


def poll(b: Replica) -> tuple[set[str], set[int], list[LoadOutcome]]:
    """One pass's get_finished, get_block_ids_with_load_errors and worker metadata, reported to the scheduler."""
    finished = b.hooks.poll_async()
    errors = b.hooks.load_errors()
    outcomes = b.hooks.take_outcomes()
    b.scheduler.on_report(WorkerReport(outcomes))
    return finished, errors, outcomes


def poll_until_finished(b: Replica, timeout_s: float = 30) -> tuple[set[str], set[int], list[LoadOutcome]]:
    deadline = threading.Event()
    timer = threading.Timer(timeout_s, deadline.set)
    timer.start()
    try:
        while not deadline.is_set():
            finished, errors, outcomes = poll(b)
            if finished:
                return finished, errors, outcomes
            deadline.wait(0.01)
    finally:
        timer.cancel()
    raise AssertionError("the asynchronous load never finished")


class Gate:
    """Holds an asynchronous load in flight: on CPU its copy waits on the loader thread, under the fake CUDA its
    end event reads as pending, until ``open``."""

    def __init__(self, b: Replica, staged: bool, monkeypatch) -> None:
        self.staged, self.opened = staged, threading.Event()
        if staged:
            monkeypatch.setattr(fake_cuda.FakeEvent, "is_pending", True)
            self._monkeypatch = monkeypatch
            return
        copy = b.worker.verify_and_copy

        def slow(load):
            if not self.opened.wait(30):
                raise TimeoutError("the gate was never opened")
            return copy(load)

        monkeypatch.setattr(b.worker, "verify_and_copy", slow)

    def open(self) -> None:
        self.opened.set()
        if self.staged:
            self._monkeypatch.setattr(fake_cuda.FakeEvent, "is_pending", False)


@DEVICES
def test_other_requests_steps_run_while_a_load_is_in_flight_and_the_bytes_arrive(flushed, monkeypatch, staged):
    a, b = replica(flushed, "A", staged), replica(flushed, "B", staged, async_loads="always")
    try:
        a.fill(1)
        a.step("a", PROMPT, BLOCKS_A)  # stores ten chunks
        b.fill(2)
        gate = Gate(b, staged, monkeypatch)
        started = threading.Thread(target=start_async, args=(b, "b", PROMPT, BLOCKS_B))
        started.start()
        started.join(10)
        assert not started.is_alive(), "starting the asynchronous load waited for its copy"
        stepped = threading.Thread(target=b.step, args=("other", OTHER, BLOCKS_OTHER))
        stepped.start()
        stepped.join(10)
        assert not stepped.is_alive(), "another request's step waited for the load in flight"
        assert poll(b) == (set(), set(), [])  # not finished while its copy runs: vLLM keeps the request parked
        assert b.scheduler.num_leases == 1  # its pages stay leased while they may be copied
        gate.open()
        finished, errors, outcomes = poll_until_finished(b)
        assert finished == {"b"} and errors == set()
        assert [(o.req_id, o.loaded_end, o.is_complete) for o in outcomes] == [("b", 10 * 32, True)]
        assert b.scheduler.num_leases == 0  # released once the load was reported
        assert torch.equal(b.tokens(0, 10 * 32, BLOCKS_B), a.tokens(0, 10 * 32, BLOCKS_A))
        assert b.hooks.poll_async() == set()  # reported once
    finally:
        a.close(), b.close()


@DEVICES
def test_a_corrupt_page_in_an_async_load_is_reported_with_its_blocks_and_never_copied(flushed, staged):
    a, b = replica(flushed, "A", staged), replica(flushed, "B", staged, async_loads="always")
    try:
        a.fill(3)
        a.step("a", PROMPT, BLOCKS_A)
        b.fill(4)
        before = b.tokens(0, 10 * 32, BLOCKS_B)
        client = a.worker.link.client()
        b.scheduler.add_request("probe", PROMPT, None, None)
        keys = b.scheduler._keys(b.scheduler._requests.pop("probe"), 10)
        lease = client.lookup(keys, LAYOUT.page_bytes)
        bad = 6
        page = client.page(lease.pages[bad].offset, LAYOUT.page_bytes)
        page[100] ^= 0x10
        client.release([lease.lease_id], wait=True)
        start_async(b, "b", PROMPT, BLOCKS_B)
        finished, errors, outcomes = poll_until_finished(b)
        assert finished == {"b"}
        assert outcomes[0].loaded_end == bad * 32 and "checksum mismatch" in outcomes[0].reason
        assert errors == set(BLOCKS_B[bad * 32 // N : 10 * 32 // N])  # in the pass that reports it finished
        after = b.tokens(0, 10 * 32, BLOCKS_B)
        assert torch.equal(after[:, :, : bad * 32], a.tokens(0, bad * 32, BLOCKS_A))
        if not staged:  # the CPU worker copies nothing from the bad page on (the GPU one stages it whole)
            assert torch.equal(after[:, :, bad * 32 :], before[:, :, bad * 32 :])
        assert b.worker.counters.checksum_failures == 1 and b.scheduler.num_leases == 0
    finally:
        a.close(), b.close()


def test_auto_loads_asynchronously_only_while_other_requests_run(flushed):
    a, b = replica(flushed, "A", False), replica(flushed, "B", False)  # async_loads "auto", the default
    try:
        a.fill(5)
        a.step("a", PROMPT, BLOCKS_A)
        s = b.scheduler
        s.add_request("alone", PROMPT, None, None)
        assert s.match("alone", 0) and not s.is_async("alone")  # nothing else to stall: in the step
        s.allocated("alone", 0)  # vLLM could not allocate after all
        s.finish("alone")
        s.add_request("running", OTHER, None, None)
        s.match("running", 0)
        s.allocated("running", 0, 0)  # admitted: it runs on the replica
        s.add_request("busy", PROMPT, None, None)
        assert s.match("busy", 0) and s.is_async("busy")  # another request is decoding: beside the steps
        s.finish("running")
        assert s.match("busy", 0) and not s.is_async("busy")  # asked again once the other one has finished
    finally:
        a.close(), b.close()


def test_every_ranks_report_is_needed_before_an_async_loads_lease_goes(flushed):
    link = PoolLink(flushed, "tp-s")
    config = ConnectorConfig(pool_socket=flushed, chunk_tokens=32, async_loads="always")
    s = PoolScheduler(config, namespace_of(LAYOUT), LAYOUT.page_bytes, N, link, tp_size=2)
    a = replica(flushed, "A", False)
    try:
        a.fill(6)
        a.step("a", PROMPT, BLOCKS_A)
        s.add_request("b", PROMPT, None, None)
        num_tokens = s.match("b", 0)
        s.allocated("b", num_tokens, 0, BLOCKS_B)
        (spec,) = s.plan_step([]).loads
        s.on_report(WorkerReport([LoadOutcome("b", 0, spec.token_end, spec.token_end)]))  # rank 0, one pass
        assert s.num_leases == 1  # rank 1 may still be copying from the pages
        s.on_report(WorkerReport([LoadOutcome("b", 0, spec.token_end, 5 * 32, "checksum mismatch")]))  # rank 1
        assert s.num_leases == 0
        assert s.finish("b")["pool_tokens"] == 5 * 32  # the tokens every rank loaded
    finally:
        s.close(), a.close()


def gated_gpu_load(socket_path, monkeypatch, seed: int):
    """A stores PROMPT, B (the GPU worker under the fake CUDA) starts its asynchronous load of it behind a closed
    gate: (A, B, the gate, B's load in flight)."""
    a, b = replica(socket_path, "A", True), replica(socket_path, "B", True, async_loads="always")
    a.fill(seed)
    a.step("a", PROMPT, BLOCKS_A)
    b.fill(seed + 1)
    gate = Gate(b, True, monkeypatch)
    start_async(b, "b", PROMPT, BLOCKS_B)
    (loads,) = b.hooks._async
    return a, b, gate, loads


def test_an_async_load_on_a_gpu_is_enqueued_a_few_groups_ahead_of_its_copies_at_each_poll(flushed, monkeypatch):
    from kvshare.integrations.vllm.gpu import ASYNC_GROUPS_AHEAD

    a, b, gate, loads = gated_gpu_load(flushed, monkeypatch, 7)  # every enqueued group reads as still copying
    try:
        groups = len(loads.pipeline.load_groups)
        assert groups > ASYNC_GROUPS_AHEAD  # the layout's layers make more groups than go ahead
        enqueued = [event.recorded for event in loads._group_events]
        assert enqueued == [True] * ASYNC_GROUPS_AHEAD + [False] * (groups - ASYNC_GROUPS_AHEAD)
        assert poll(b) == (set(), set(), [])  # the groups ahead still copy: nothing more is enqueued
        assert sum(event.recorded for event in loads._group_events) == ASYNC_GROUPS_AHEAD
        gate.open()  # they ended: each poll tops the groups ahead up, the last one records the load's end
        finished, errors, outcomes = poll_until_finished(b)
        assert all(event.recorded for event in loads._group_events)
        assert finished == {"b"} and errors == set() and outcomes[0].is_complete
        assert torch.equal(b.tokens(0, 10 * 32, BLOCKS_B), a.tokens(0, 10 * 32, BLOCKS_A))
    finally:
        a.close(), b.close()


def test_an_async_load_whose_arena_registration_went_midway_fails_and_enqueues_no_more(flushed, monkeypatch):
    a, b, gate, loads = gated_gpu_load(flushed, monkeypatch, 9)
    try:
        loads.pipeline._registered_arena = object()  # another pool's arena is registered now
        gate.open()
        finished, errors, outcomes = poll_until_finished(b)
        assert finished == {"b"} and not outcomes[0].is_complete
        assert "arena changed" in outcomes[0].reason and outcomes[0].loaded_end == 0
        assert errors == set(BLOCKS_B[: 10 * 32 // N])  # vLLM recomputes every block of it
        assert not all(event.recorded for event in loads._group_events)  # nothing enqueued after the change
        assert b.scheduler.num_leases == 0
    finally:
        a.close(), b.close()
