"""The staging pipeline (kvshare.transfer.pipeline) on CPU under the fake CUDA: its destination contract, the
lifetime of its staging buffers and of the arena's registration.

Each ``KVDestination`` (the built-in engine's ``EngineKV``, vLLM's ``PagedDestination``) runs the same
contract: gathering a unit of pages yields the canonical page bytes of the tokens it holds, and scattering
them back restores the KV exactly. The order checks spy on the fake streams and events: program order alone
cannot show that a buffer is refilled only after its last use, so the spies record what waits on what.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.integrations.vllm.paged_destination import PagedKV, token_slots
from kvshare.integrations.vllm.paged_tensors import fill_random_, paged_layers
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.transfer.base import TransferConfig
from kvshare.transfer.layouts import EngineKV, as_bits, chunks_view, engine_to_chunks
from kvshare.transfer.pipeline import StagingPipeline, UnitWork
from kvshare.transfer.plan import plan_unit
from kvshare.transfer.scratch import reserve_scratch
from tests.transfer import fake_cuda
from tests.transfer.helpers import random_kv

CPU = torch.device("cpu")
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=16)  # 3 KiB pages
NUM_PAGES, BLOCK_SIZE = 3, 8
BLOCKS = [11, 3, 7, 0, 9, 1]  # the request's blocks, out of order: 2 per page


@pytest.fixture
def fake(monkeypatch):
    fake = fake_cuda.FakeCuda()
    fake_cuda.install(monkeypatch, fake)
    return fake


def engine_destination(kv: torch.Tensor) -> EngineKV:
    return EngineKV(as_bits(kv), 1, LAYOUT.chunk_tokens)  # pages hold chunks 1..3


def paged_destination(kv: torch.Tensor, order: str):
    """vLLM blocks of memory order ``order`` holding chunks 1..3 of ``kv`` at BLOCKS (others random)."""
    layers, paged = paged_layers(
        order, LAYOUT.num_layers, 16, BLOCK_SIZE, LAYOUT.num_kv_heads, LAYOUT.head_dim, torch.bfloat16, CPU
    )
    for index, layer in enumerate(layers):
        fill_random_(layer, 50 + index)
    table = [0, 0] + BLOCKS  # chunk 0's blocks are not the call's
    paged_kv = PagedKV(layers, paged, LAYOUT)
    destination = paged_kv.destination(token_slots(table, [1, 2, 3], LAYOUT.chunk_tokens, BLOCK_SIZE))
    unit = plan_unit([0] * NUM_PAGES, LAYOUT, (0, LAYOUT.num_layers), (0, NUM_PAGES), None)
    destination.scatter(unit, canonical(kv))  # the same tokens in vLLM's blocks
    return destination, layers


def canonical(kv: torch.Tensor) -> torch.Tensor:
    """Chunks 1..3 of kv as canonical pages ``[n, L, 2, C, H, D]`` (integers)."""
    pages = torch.empty(NUM_PAGES * LAYOUT.page_bytes, dtype=torch.uint8)
    staged = chunks_view(pages, LAYOUT, NUM_PAGES)
    engine_to_chunks(staged, as_bits(kv), LAYOUT.chunk_tokens)
    return staged


@pytest.mark.parametrize("which", ["engine", "vllm LBNHC", "vllm 5d", "vllm padded"])
def test_every_destination_gathers_canonical_pages_and_scatters_them_back(which):
    """Fails when a destination gathers another byte order than the canonical page, or scatters elsewhere."""
    kv = random_kv(LAYOUT, 4 * LAYOUT.chunk_tokens, seed=1)
    if which == "engine":
        destination = engine_destination(kv.clone())
        state = [destination.kv]
    else:
        destination, layers = paged_destination(kv, which.split()[1])
        state = [blocks.clone() for blocks in destination.blocks]  # [2, B, N, H, D'] per layer
    expected = canonical(kv)
    for layers in [(0, 2), (2, 3)]:  # a unit per layer group
        unit = plan_unit([0] * NUM_PAGES, LAYOUT, layers, (1, NUM_PAGES), None)  # pages 1..2 of the call
        buffer = torch.zeros(unit.num_bytes, dtype=torch.uint8)
        staged = chunks_view(buffer, LAYOUT, unit.num_pages, unit.num_layers)
        destination.gather(unit, staged)
        assert torch.equal(staged, expected[1:, layers[0] : layers[1]])
        if which == "engine":
            destination.kv[layers[0] : layers[1]].zero_()
        else:
            for blocks in destination.blocks[layers[0] : layers[1]]:
                blocks.zero_()
        destination.scatter(unit, staged)
    if which == "engine":
        C = LAYOUT.chunk_tokens
        assert torch.equal(destination.kv[:, :, :, 2 * C :], as_bits(kv)[:, :, :, 2 * C :])
        assert not destination.kv[:, :, :, : 2 * C].any()  # chunks 0 and 1: not the unit's
    else:  # the pages' blocks restored, every other block left as zeroed
        moved = BLOCKS[2:]
        others = [b for b in range(state[0].shape[1]) if b not in moved]
        for before, blocks in zip(state, destination.blocks):
            assert torch.equal(blocks[:, moved], before[:, moved]) and not blocks[:, others].any()


class Spy:
    """Records, in order, every event recorded and waited for on the fake streams, and every host copy."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    def install(self, monkeypatch, pipeline: StagingPipeline) -> None:
        spy = self

        class SpyStream(fake_cuda.FakeStream):
            def __init__(self, name: str) -> None:
                super().__init__()
                self.name = name

            def wait_event(self, event) -> None:
                spy.log.append(("wait", self.name, id(event)))

        class SpyEvent(fake_cuda.FakeEvent):
            def record(self, stream=None) -> None:
                spy.log.append(("record", getattr(stream, "name", "?"), id(self)))

        monkeypatch.setattr(torch.cuda, "Event", SpyEvent)
        for lane in {id(lane): lane for lane in (pipeline.load_lane, pipeline.store_lane)}.values():
            lane.copy, lane.reshape = SpyStream("copy"), SpyStream("reshape")
            lane.idle = [SpyEvent() for _ in lane.idle]
        real = pipeline.host_copies

        def host_copies(copies, buffer, stream, client, to_device):
            spy.log.append(("copy", stream.name, buffer.data_ptr()))
            real(copies, buffer, stream, client, to_device)

        monkeypatch.setattr(pipeline, "host_copies", host_copies)

    def check_buffer_reuse(self, lane, waiter: str) -> int:
        """Between two host copies with a buffer, its idle event is recorded and then waited for on
        ``waiter`` (a load: the copy stream; a store: the reshape stream, before its gather); the reuses seen."""
        idle = {buffer.data_ptr(): id(event) for buffer, event in zip(lane.buffers, lane.idle)}
        last_use: dict[int, int] = {}
        reuses = 0
        for i, (what, _, target) in enumerate(self.log):
            if what != "copy" or target not in idle:
                continue
            if target in last_use:
                between = self.log[last_use[target] + 1 : i]
                recorded = [j for j, e in enumerate(between) if e[0] == "record" and e[2] == idle[target]]
                waited = [j for j, e in enumerate(between) if e == ("wait", waiter, idle[target])]
                assert recorded and waited and recorded[0] < waited[-1], f"buffer reused unordered at entry {i}"
                reuses += 1
            last_use[target] = i
        return reuses


@pytest.mark.parametrize("shared_lane", [True, False])
def test_a_staging_buffer_is_refilled_only_after_its_last_use(fake, client, monkeypatch, shared_lane):
    """Fails when a loop reuses a buffer without waiting for its idle event (the load's
    ``lane.copy.wait_event(lane.idle[index])`` or the store's ``lane.reshape.wait_event(lane.idle[index])``)."""
    config = TransferConfig(min_copy_bytes=LAYOUT.layer_bytes, staging_bytes=LAYOUT.layer_bytes, copy_method="torch")
    pipeline = StagingPipeline(LAYOUT, config, CPU, shared_lane=shared_lane)
    scratch = reserve_scratch(client, LAYOUT.page_bytes, NUM_PAGES)
    try:
        pipeline.ensure_registered(client)
        spy = Spy()
        spy.install(monkeypatch, pipeline)
        kv = random_kv(LAYOUT, 4 * LAYOUT.chunk_tokens, seed=2)
        destination = engine_destination(kv)
        units = [u for group in pipeline.plan_groups(scratch.offsets, None) for u in group]  # 9 units, 2 buffers
        pipeline.store_after(torch.cuda.current_stream())
        pipeline.store_steps(client, [UnitWork(u, destination, None) for u in units])
        assert spy.check_buffer_reuse(pipeline.store_lane, "reshape") == len(units) - 2
        spy.log.clear()
        loaded = torch.zeros_like(kv)
        groups = [
            [UnitWork(u, engine_destination(loaded), None) for u in group]
            for group in pipeline.plan_groups(scratch.offsets, None)
        ]
        failures: list = []
        start, end = torch.cuda.Event(), torch.cuda.Event()
        list(pipeline.load_steps(client, groups, start, end, lambda g, s: None, failures.append))
        assert not failures and spy.check_buffer_reuse(pipeline.load_lane, "copy") == len(units) - 2
        assert torch.equal(as_bits(loaded)[:, :, :, LAYOUT.chunk_tokens :], as_bits(kv)[:, :, :, LAYOUT.chunk_tokens :])
    finally:
        pipeline.close()
        scratch.release(client)


def test_another_arena_is_registered_only_after_every_copy_on_the_old_one_ended(fake, pool_socket, monkeypatch):
    """The pool restarted (a new arena): the pipeline waits for its lanes before it unpins the old arena, and
    does not rely on the registration's own device-wide wait. Fails when ``self.sync()`` is removed from
    ``StagingPipeline._release_registration``."""
    events: list[str] = []
    monkeypatch.setattr("kvshare.transfer.registration._wait_for_copies", lambda: None)
    unregister = fake.cudaHostUnregister
    monkeypatch.setattr(fake, "cudaHostUnregister", lambda ptr: events.append("unregister") or unregister(ptr))
    config = TransferConfig(staging_bytes=LAYOUT.page_bytes, min_copy_bytes=LAYOUT.layer_bytes, copy_method="torch")
    pipeline = StagingPipeline(LAYOUT, config, CPU, shared_lane=False)
    for lane, name in ((pipeline.load_lane, "load"), (pipeline.store_lane, "store")):
        lane.synchronize = lambda name=name: events.append(f"{name} synchronized")
    first, second = PoolClient(pool_socket).connect(), PoolClient(pool_socket).connect()
    try:
        pipeline.ensure_registered(first)
        old = pipeline.registration
        events.clear()
        pipeline.ensure_registered(second)
        assert pipeline.registration is not old and old.refs == 0
        assert "unregister" in events
        assert {"load synchronized", "store synchronized"} <= set(events[: events.index("unregister")])
        events.clear()
        pipeline.close()
        assert events.index("store synchronized") < events.index("unregister") and pipeline.registration is None
    finally:
        first.close(), second.close()


def test_a_closed_pipeline_refuses_to_register_again(fake, client):
    pipeline = StagingPipeline(LAYOUT, TransferConfig(copy_method="torch"), CPU, shared_lane=True)
    pipeline.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipeline.ensure_registered(client)
    assert fake.registered == {}


def test_a_closed_pipeline_holds_no_view_that_keeps_the_arena_mapped(fake, pool_socket):
    """Once the pipeline let the arena go, the client's unmap really unmaps it (a view left behind would keep
    a pool-sized mapping alive). Fails when ``_release_registration`` keeps ``_registered_arena``."""
    client = PoolClient(pool_socket).connect()
    pipeline = StagingPipeline(LAYOUT, TransferConfig(copy_method="torch"), CPU, shared_lane=True)
    pipeline.ensure_registered(client)
    pipeline.close()
    mapping = client._mmap
    client.close()
    assert mapping.closed
