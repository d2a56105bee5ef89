"""The connector's GPU path on a real GPU with vLLM-shaped flash-attention tensors (suite gpu; no vLLM needed).

GPU vLLM cannot run on the machines here; these run the worker's staged path (2-D copies into GPU
staging, scatter/gather on the GPU, events per layer group, WSUM32 verification on the GPU) on
tensors shaped and strided like vLLM 0.32's FLASH_ATTN caches, against a real pool: bytes across
replicas with a delayed producer, the delay-injection ordering checks with their deliberately
unordered controls (every memory order, both directions, both copy methods), GPU checksums equal
to the host's, and every injected corruption caught. Skipped without CUDA.
"""

import random

import pytest
import torch

from kvshare.integrations.vllm.gpu import GpuKVWorker
from kvshare.integrations.vllm.ordercheck import staged_checks
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind, page_checksum
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool
from tests.integrations.vllm.staged_replica import Replica

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

L, H, D, N, C = 4, 8, 128, 16, 256
NUM_BLOCKS = 96
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16", chunk_tokens=C)  # 4 MiB pages
PROMPT = list(range(5, 5 + 3 * C + 40))  # three chunks and a tail
ORDERS = ("LBNHC", "LBHNC", "padded", "5d")


@pytest.fixture(scope="module")
def pool():
    with running_pool("256MiB", ("--extent-size", "16MiB")) as socket_path:  # 4 pages per extent
        yield socket_path


@pytest.fixture
def flushed(pool):
    with PoolClient(pool, name="flush") as client:
        client.flush()
    return pool


def replica(socket_path, name, order, **config):
    return Replica(socket_path, name, LAYOUT, order, NUM_BLOCKS, N, torch.device("cuda"), **config)


def keys_of(r, num_chunks):
    r.scheduler.add_request("probe", PROMPT, None, None)
    return r.scheduler._keys(r.scheduler._requests.pop("probe"), num_chunks)


@pytest.mark.parametrize("order", ORDERS)
def test_cross_replica_bytes_on_cuda_with_a_delayed_producer(flushed, order):
    a, b = replica(flushed, "A", order), replica(flushed, "B", order)
    blocks_a, blocks_b = list(range(0, 50)), list(range(95, 45, -1))
    try:
        assert isinstance(a.worker, GpuKVWorker) and isinstance(b.worker, GpuKVWorker)
        fresh = [torch.randn_like(layer) for layer in a.layers]

        def produce(index):  # the producer: a long sleep on vLLM's stream, then the layer's KV written behind it
            torch.cuda._sleep(50_000_000)
            a.layers[index].copy_(fresh[index])

        assert a.step("a", PROMPT, blocks_a, write_layer=produce) is None  # save_layer must wait for the writes
        assert a.worker.counters.stored_chunks == 3
        outcome = b.step("b", PROMPT, blocks_b)
        assert outcome.is_complete and outcome.loaded_end == 3 * C
        assert torch.equal(b.tokens(0, 3 * C, blocks_b), a.tokens(0, 3 * C, blocks_a))
        assert b.worker.counters.load_bytes == 3 * LAYOUT.page_bytes and b.worker.counters.verified_pages == 3
        client = a.worker.link.client()
        lease = client.lookup(keys_of(a, 3), LAYOUT.page_bytes)
        for page in lease.pages:  # summed on the GPU at the store, equal to the host's sum of the page
            assert page.checksum_kind == ChecksumKind.WSUM32
            assert page.checksum == page_checksum(client.page(page.offset, page.page_bytes), ChecksumKind.WSUM32)
        client.release([lease.lease_id], wait=True)
    finally:
        a.close(), b.close()


def test_a_step_vllm_may_replay_as_one_graph_has_its_whole_load_before_the_forward_reads(flushed):
    """The forward of a step marked ``no_layer_hooks`` calls no wait_for_layer_load; what it reads of every layer
    on vLLM's stream is the pool's bytes, and the load counts (fake CUDA: test_staged's negative control)."""
    a, b = replica(flushed, "A", "LBNHC"), replica(flushed, "B", "LBNHC")
    blocks_a, blocks_b = list(range(0, 50)), list(range(95, 45, -1))
    try:
        a.step("a", PROMPT, blocks_a)
        seen = {}

        def read(index):  # the graph's attention layer reads its blocks, on vLLM's stream
            seen[index] = b.layers[index].clone()

        outcome = b.step("b", PROMPT, blocks_b, write_layer=read, wait_layers=False, no_layer_hooks=True)
        assert outcome.is_complete and outcome.loaded_end == 3 * C and not b.last_errors
        for index in range(L):
            b.layers[index].copy_(seen[index])  # what the forward read, in place of the blocks
        assert torch.equal(b.tokens(0, 3 * C, blocks_b), a.tokens(0, 3 * C, blocks_a))
    finally:
        a.close(), b.close()


def test_every_injected_corruption_is_caught_on_the_gpu(flushed):
    a, b = replica(flushed, "A", "LBNHC"), replica(flushed, "B", "LBNHC")
    blocks_a, blocks_b = list(range(0, 50)), list(range(95, 45, -1))
    rng = random.Random(1)
    try:
        for layer in a.layers:
            layer.normal_()
        a.step("a", PROMPT, blocks_a)
        client = a.worker.link.client()
        keys = keys_of(a, 3)
        for trial in range(10):
            lease = client.lookup(keys, LAYOUT.page_bytes)
            bad = rng.randrange(3)
            page = client.page(lease.pages[bad].offset, LAYOUT.page_bytes)
            position = rng.randrange(page.size)
            original = int(page[position])
            page[position] ^= 1 << rng.randrange(8)
            outcome = b.step(f"b{trial}", PROMPT, blocks_b)
            page[position] = original
            client.release([lease.lease_id], wait=True)
            assert outcome.loaded_end == bad * C and "checksum mismatch" in outcome.reason, (trial, bad, position)
            assert b.last_errors == set(blocks_b[bad * C // N : 3 * C // N])
            a.step(f"a{trial}", PROMPT, blocks_a)  # stored again (the bad chunk was dropped)
        assert b.worker.counters.checksum_failures == 10
    finally:
        a.close(), b.close()


def test_ordering_under_delay_every_layout_both_directions_with_the_controls_caught(pool):
    with PoolClient(pool, name="ordercheck") as client:
        results = staged_checks(client, torch.device("cuda", torch.cuda.current_device()))
    assert results
    for r in results:
        if r.skipped:
            continue
        if r.kind == "control":
            assert r.caught, f"{r.path}: the deliberately unordered variant came out right ({r.detail})"
        else:
            assert r.bytes_checked > 0 and r.mismatched_bytes == 0, f"{r.path}: {r.mismatched_bytes} bytes wrong"
    ran = {r.path.split(" ")[1] for r in results if not r.skipped}
    assert ran == set(ORDERS)
