"""Asynchronous loads and copies ahead on a real GPU (suite gpu; no vLLM needed; skipped without CUDA).

vLLM-shaped flash-attention tensors and a real pool, the connector's sides driven in vLLM's order
(staged_replica.Replica): an asynchronous load slowed on its copy stream leaves vLLM's stream free and lands
whole; a copy ahead delayed on its own stream (enqueued from another thread, as the hint listener does) is read by
the load only after it landed; the bytes loaded equal the bytes stored on both paths.
"""

import threading
import time

import pytest
import torch

from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.prefetch import Prefetcher
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.link import PoolLink
from kvshare.pool.spawn import running_pool
from kvshare.router.hints import make_hint
from kvshare.transfer.base import TransferConfig
from tests.integrations.vllm.staged_replica import Replica, namespace_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

L, H, D, N, C = 4, 8, 128, 16, 256
NUM_BLOCKS = 96
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16", chunk_tokens=C)  # 4 MiB pages
PROMPT = list(range(5, 5 + 3 * C + 40))  # three chunks and a tail
BLOCKS_A, BLOCKS_B = list(range(0, 50)), list(range(95, 45, -1))
DELAY = 1_000_000_000  # GPU cycles: ~0.5 s, far longer than enqueueing the loads


@pytest.fixture(scope="module")
def pool():
    with running_pool("256MiB", ("--extent-size", "16MiB")) as socket_path:
        yield socket_path


@pytest.fixture
def flushed(pool):
    with PoolClient(pool, name="flush") as client:
        client.flush()
    return pool


def replica(socket_path, name, transfer=None, **config):
    kwargs = {"transfer": transfer} if transfer is not None else None
    return Replica(
        socket_path, name, LAYOUT, "LBNHC", NUM_BLOCKS, N, torch.device("cuda"), worker_kwargs=kwargs, **config
    )


def test_an_async_load_leaves_vllms_stream_free_and_lands_whole(flushed):
    """Fails when the asynchronous load makes vLLM's stream wait for it (the marker after it would wait the
    delay), or when get_finished names it before its copies ended."""
    slow = TransferConfig(staging_bytes=128 << 20, load_delay_cycles=DELAY)
    a, b = replica(flushed, "A"), replica(flushed, "B", slow, async_loads="always")
    try:
        for layer in a.layers:
            layer.normal_()
        a.step("a", PROMPT, BLOCKS_A)
        s = b.scheduler
        s.add_request("b", PROMPT, None, None)
        num_tokens = s.match("b", 0)
        s.allocated("b", num_tokens, 0, BLOCKS_B)
        plan = s.plan_step([])
        b.hooks.start_load(plan)
        b.hooks.wait_for_save(plan)
        marker = torch.cuda.Event()
        marker.record(torch.cuda.current_stream())  # vLLM's next step, enqueued behind the load's start
        marker.synchronize()
        assert b.hooks.poll_async() == set()  # the load's copies are still delayed
        deadline = time.monotonic() + 30
        while not (finished := b.hooks.poll_async()) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert finished == {"b"} and not b.hooks.load_errors()
        (outcome,) = b.hooks.take_outcomes()
        s.on_report(WorkerReport([outcome]))
        assert outcome.is_complete and outcome.loaded_end == 3 * C and s.num_leases == 0
        assert torch.equal(b.tokens(0, 3 * C, BLOCKS_B), a.tokens(0, 3 * C, BLOCKS_A))
    finally:
        a.close(), b.close()


def test_a_delayed_copy_ahead_from_another_thread_is_read_only_once_it_landed(flushed, monkeypatch):
    """Fails when the load's scatter out of the prefetch buffer does not wait for the copies ahead's event: it
    then reads the buffer before the delayed copies wrote it."""
    a, b = replica(flushed, "A"), replica(flushed, "B")
    try:
        for layer in a.layers:
            layer.normal_()
        a.step("a", PROMPT, BLOCKS_A)
        b.worker.prepare()
        device = b.worker.prefetch_device(64 << 20)
        prefetcher = Prefetcher(PoolLink(flushed, "B-ahead"), LAYOUT, namespace_of(LAYOUT), ["m"], device)
        b.worker.prefetcher = prefetcher
        enqueue = b.worker.pipeline.prefetch

        def delayed(client, units, buffers, stream):  # a late copy stream: a reader that does not wait races it
            with torch.cuda.stream(stream):
                torch.cuda._sleep(DELAY)
            enqueue(client, units, buffers, stream)

        monkeypatch.setattr(b.worker.pipeline, "prefetch", delayed)
        hinted = threading.Thread(target=prefetcher.on_hint, args=(make_hint("m", None, PROMPT),))
        hinted.start()
        hinted.join(30)
        outcome = b.step("b", PROMPT, BLOCKS_B)  # at once: the copies ahead are still in flight
        assert outcome.is_complete and outcome.loaded_end == 3 * C
        assert prefetcher.take_counters().prefetch_hits == 3
        assert torch.equal(b.tokens(0, 3 * C, BLOCKS_B), a.tokens(0, 3 * C, BLOCKS_A))
        prefetcher.tick()
    finally:
        b.close()
        a.close()
        if b.worker.prefetcher is not None:
            b.worker.prefetcher.close()
