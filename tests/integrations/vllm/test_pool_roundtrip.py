"""The connector's two sides against a real pool, with vLLM-shaped CPU tensors (no vLLM needed).

Replica A computes a prompt (stores), replica B loads it into other blocks: the bytes B
holds afterwards must be the bytes A computed, and only where the load was planned.
"""

import os
import random
import signal

import pytest
import torch

from kvshare.integrations.vllm.layout import PagedLayout, reference_gather
from kvshare.integrations.vllm.metadata import LoadOutcome, WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.pool.link import PoolLink
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.integrations.vllm.worker import PoolKVWorker
from kvshare.keys import Namespace, chunk_keys, namespace_digest
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool, start_pool, stop_process
from tests.integrations.vllm.servers import private_socket
from tests.verdicts import spy_verdicts

L, H, D, N, C = 2, 2, 64, 32, 64
NUM_BLOCKS = 40
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32", chunk_tokens=C)
NAMESPACE = Namespace("tiny", "f" * 32, "float32", L, H, D, chunk_tokens=C, engine_family="vllm")
POOL_ARGS = ("--extent-size", "4MiB")
LAYERED = pytest.mark.parametrize("layered", [False, True], ids=["before-forward", "layered"])


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Replica:
    """One vLLM replica's connector sides over fake CPU_ATTN KV tensors."""

    def __init__(self, socket_path, name, seed, clock=None, rng=None, layered=False, **config):
        self.layered = layered  # loads copied layer by layer beside the forward, as the connector does on CPU
        self.num_layered = 0  # loads that took that path (the others fell back to a synchronous load)
        self.config = ConnectorConfig(pool_socket=socket_path, chunk_tokens=C, replica=name, **config)
        self.clock = clock or FakeClock()
        self.scheduler = PoolScheduler(self.config, NAMESPACE, LAYOUT.page_bytes, N,
                                       PoolLink(socket_path, f"{name}-sched", clock=self.clock), clock=self.clock)
        self.worker = PoolKVWorker(LAYOUT, PoolLink(socket_path, f"{name}-worker", clock=self.clock),
                                   verify_fraction=self.config.verify_fraction, copy_threads=self.config.copy_threads,
                                   rng=rng)
        gen = torch.Generator().manual_seed(seed)
        self.layers = [torch.randn(NUM_BLOCKS, H, N, 2 * D, generator=gen) for _ in range(L)]
        self.paged = PagedLayout("cpu_attn", NUM_BLOCKS, N, H, D, torch.float32)
        self.worker.register(self.layers, self.paged)

    def run_prefill(self, req_id, prompt, block_ids, local=0, step_tokens=None):
        """Schedule a prompt like vLLM would: lookup, allocate, then prefill steps; returns the load outcome."""
        self.scheduler.add_request(req_id, prompt, None, None)
        external = self.scheduler.match(req_id, local)
        self.scheduler.allocated(req_id, external, local)
        computed, outcome = local + external, None  # vLLM counts loaded tokens as computed
        while computed < len(prompt):
            n = min(step_tokens or len(prompt), len(prompt) - computed)
            plan = self.scheduler.plan_step([ScheduledRequest(req_id, computed, n, block_ids)])
            outcomes = self.load(plan.loads)
            for spec in plan.stores:  # after it
                self.worker.store(spec)
            self.scheduler.on_report(WorkerReport(outcomes))
            outcome = outcomes[0] if outcomes else outcome
            computed += n
        return external, outcome

    def load(self, specs):
        """The step's loads: all before the forward, or (``layered``) each attention layer of the forward
        waiting for its own layer, as the connector runs them on CPU."""
        if not self.layered:
            return [self.worker.load(spec) for spec in specs]
        begun = [self.worker.begin_load(spec) for spec in specs]
        layered = [load for load in begun if not isinstance(load, LoadOutcome)]
        self.num_layered += len(layered)
        if not layered:
            return begun  # loads the layered path does not take ran synchronously
        loads = self.worker.start_layered(layered)
        for index in range(L):  # the forward's attention layers
            loads.wait_layer(index)
        outcomes, all_waited = loads.finish()
        assert all_waited
        finished = iter(outcomes)
        return [load if isinstance(load, LoadOutcome) else next(finished) for load in begun]

    def tokens(self, start, num, block_ids):
        return torch.stack([reference_gather(layer, self.paged, start, num, block_ids) for layer in self.layers])

    def close(self):
        self.scheduler.close()
        self.worker.close()


@pytest.fixture
def pool():
    with running_pool("16MiB", POOL_ARGS) as path:
        yield path


def pool_stats(path):
    with PoolClient(path, name="test") as client:
        return client.stats()


PROMPT = list(range(3, 303))  # 300 tokens: chunks 0..3 (256 tokens) and a 44-token tail
BLOCKS_A = list(range(0, 10))
BLOCKS_B = list(range(39, 29, -1))  # other blocks, in another order


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
        assert b.scheduler.finish("r2") == {"replica": "B", "local_tokens": 0, "pool_tokens": 256, "computed_tokens": 44}
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


def flip_a_byte_of_chunk_2(pool):
    keys = chunk_keys(namespace_digest(NAMESPACE), PROMPT, C)
    with PoolClient(pool, name="vandal") as client:
        pages = client.lookup(keys, LAYOUT.page_bytes, lease=False).pages
        client.page(pages[2].offset, LAYOUT.page_bytes)[1000] ^= 0xFF


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
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2, rng=FixedDraw(draw), verify_fraction=0.5,
                                                      layered=layered)
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
            assert all(torch.equal(layer.view(NUM_BLOCKS, -1)[untouched], kept) for layer, kept in zip(b.layers, before))
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


def plan_load_of_a_prefill(a: "Replica", b: "Replica"):
    """A prefills PROMPT into the pool; B matches all 256 tokens of it and plans their load (returned)."""
    a.run_prefill("r1", PROMPT, BLOCKS_A)
    b.scheduler.add_request("r2", PROMPT, None, None)
    assert b.scheduler.match("r2", 0) == 256
    b.scheduler.allocated("r2", 256, 0)
    return b.scheduler.plan_step([ScheduledRequest("r2", 256, 44, BLOCKS_B)])


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
        pool_pid = link.pool_pid
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
                writer.commit(reserved.reservation_id,
                              [page_checksum(writer.page(o, LAYOUT.page_bytes)) for _, o in reserved.grants])
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
    """A lease granted by a pool that is gone (another pool pid) is released while the link is down. Lease
    ids restart in every pool, so the same id may name a lease this holder took from the pool it reconnects
    to, whose copy still runs: that lease must stay.
    Fails when the scheduler files the release under the link's last pool instead of the lease's own."""
    from kvshare.integrations.vllm.plan import HeldLease

    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2)
    try:
        a.run_prefill("r1", PROMPT, BLOCKS_A)
        link = b.scheduler.link
        live = link.client().lookup(chunk_keys(namespace_digest(NAMESPACE), PROMPT, C), LAYOUT.page_bytes)
        assert live.lease_id and pool_stats(pool)["leases"] == 1
        stale = HeldLease(live.lease_id, 0, [], [], b.clock.now, (link.pool_pid + 1, link.holder))
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
        scheduler = PoolScheduler(config, NAMESPACE, LAYOUT.page_bytes, N, PoolLink(path, "tp-sched", clock=clock),
                                  clock=clock, tp_size=2)
        try:
            first = scheduler._reserve(StoreSpec("r1", digest, 0, keys, (0,)))
            stop_process(proc)
            proc = start_pool(path, "16MiB", POOL_ARGS)
            assert scheduler.link.reconnect_now() is not None
            second = scheduler._reserve(StoreSpec("r2", digest, 0, keys, (0,)))
            assert second.reservation_id == first.reservation_id and second.pool_pid != first.pool_pid
            assert pool_stats(path)["reservations"] == 1
            for rank in range(2):
                part = StorePart(first.reservation_id, first.pool_pid, rank, True, (1,) * len(first.grants))
                scheduler._settle_part(part)
            assert pool_stats(path)["reservations"] == 1  # the new pool's reservation still waits for its parts
        finally:
            scheduler.close()
            stop_process(proc)
