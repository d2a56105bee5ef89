"""The connector's GPU path under imposed delay: byte round trips and ordering, every layout, both directions.

The study's worst bug was a copy that did not depend on the producer's stream. For each memory
order vLLM's flash attention may hand over (kvshare.integrations.vllm.paged_tensors) and each copy
method, through the GPU worker (gpu, gpu_stores, paged_destination):

- round trip: a store of random KV, then a load into other (descending) blocks: bytes equal, every
  page verified on the GPU, nothing outside the loaded blocks touched;
- store-order: vLLM's stream sleeps, then writes the KV, then ``save_layer`` per layer: the pages
  must hold the new bytes. Control (``UnorderedPipeline``): the store does not wait for vLLM's
  stream, and must come out wrong;
- load-order: the copy stream sleeps before its copies; a reader that waits for each layer
  (``wait_layer``) before reading sees the loaded bytes; the control reads without waiting and
  must see the old ones.

Run by ``kvshare validate --level bytes --device cuda`` and tests/integrations/vllm/test_cuda.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time

import torch

from kvshare.integrations.vllm.gpu import GpuKVWorker
from kvshare.integrations.vllm.layout import as_bits, reference_gather
from kvshare.integrations.vllm.metadata import LoadSpec, StoreSpec
from kvshare.integrations.vllm.paged_tensors import MEMORY_ORDERS, fill_random_, paged_layers
from kvshare.keys import KEY_BYTES
from kvshare.layout import KVLayout
from kvshare.transfer.base import TransferConfig
from kvshare.transfer.copiers import CopyError
from kvshare.transfer.ordercheck import UnorderedPipeline
from kvshare.transfer.pipeline import StagingPipeline
from kvshare.transfer.roundtrip import PathResult

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=32)  # 16 KiB per layer
BLOCK_SIZE, NUM_PAGES, NUM_BLOCKS = 16, 8, 40
# a group per layer, 3 pages per staging buffer: several units per group, both buffers of each direction
SMALL = TransferConfig(min_copy_bytes=LAYOUT.layer_bytes, staging_bytes=3 * LAYOUT.layer_bytes)
SENTINEL = 0x5A5A


class FixedLink:
    """A PoolLink over one given client (the validation's own, whose arena is registered once)."""

    def __init__(self, client) -> None:
        self._client = client

    def client(self):
        return self._client

    @property
    def pool_id(self) -> bytes:
        return self._client.hello.pool_id

    def reconnect_now(self):
        return self._client

    def failed(self, exc: BaseException) -> None:
        raise exc  # a check's pool call must not fail quietly

    def close(self) -> None:
        pass


class _Bench:
    """One memory order's layers and the workers that move them (ordered, delayed, unordered)."""

    def __init__(self, client, order: str, method: str, device, delay_cycles: int, seed: int) -> None:
        self.client, self.device, self.seed = client, device, seed
        self.layers, self.paged = paged_layers(
            order,
            LAYOUT.num_layers,
            NUM_BLOCKS,
            BLOCK_SIZE,
            LAYOUT.num_kv_heads,
            LAYOUT.head_dim,
            getattr(torch, LAYOUT.dtype),
            device,
        )
        config = dataclasses.replace(SMALL, copy_method=method)
        delayed = dataclasses.replace(config, load_delay_cycles=delay_cycles)
        self.delay_cycles = delay_cycles
        self.workers = {}
        for name, cfg, cls in (
            ("plain", config, StagingPipeline),
            ("delayed", delayed, StagingPipeline),
            ("unordered", config, UnorderedPipeline),
        ):
            worker = GpuKVWorker(LAYOUT, FixedLink(client), transfer=cfg, pipeline_class=cls)
            worker.register(self.layers, self.paged)
            self.workers[name] = worker
        self.namespace = hashlib.blake2b(b"kvshare-vllm-ordercheck" + os.urandom(8), digest_size=KEY_BYTES).digest()
        self.keys = tuple(
            hashlib.blake2b(self.namespace + bytes([i]), digest_size=KEY_BYTES).digest() for i in range(NUM_PAGES)
        )
        self.blocks_a = list(range(NUM_PAGES * LAYOUT.chunk_tokens // BLOCK_SIZE))
        self.blocks_b = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - len(self.blocks_a), -1))

    def close(self) -> None:
        self.client.flush(self.namespace)
        for worker in self.workers.values():
            worker.close()

    def _fresh(self) -> list[torch.Tensor]:
        return [fill_random_(torch.empty_like(layer), self.seed * 100 + i) for i, layer in enumerate(self.layers)]

    def _expected_pages(self, fresh: list[torch.Tensor]) -> torch.Tensor:
        """The canonical pages of ``fresh`` at blocks_a, [n, L, 2, C, H, D] as integers (slow reference, CPU)."""
        C = LAYOUT.chunk_tokens
        per_layer = [
            reference_gather(f.cpu(), self.paged, 0, NUM_PAGES * C, self.blocks_a) for f in fresh
        ]  # [2, T, H, D]
        stacked = torch.stack(per_layer).unflatten(2, (NUM_PAGES, C))  # [L, 2, n, C, H, D]
        return as_bits(stacked.permute(2, 0, 1, 3, 4, 5).contiguous())

    def _stored_pages(self) -> torch.Tensor:
        lease = self.client.lookup(list(self.keys), LAYOUT.page_bytes)
        try:
            pages = [torch.from_numpy(self.client.page(p.offset, p.page_bytes).copy()) for p in lease.pages]
        finally:
            self.client.release([lease.lease_id], wait=True)
        return torch.stack(pages).view(torch.int16).view(len(pages), *LAYOUT.page_shape) if pages else torch.empty(0)

    def store(self, worker_name: str, delayed: bool) -> tuple[int, int]:
        """vLLM's stream sleeps (when ``delayed``), then writes each layer and saves it. (bytes checked, wrong)."""
        self.client.flush(self.namespace)
        fresh = self._fresh()
        for layer in self.layers:
            layer.zero_()  # what a store that does not wait would copy
        torch.cuda.synchronize(self.device)
        stores = self.workers[worker_name].start_stores(
            [StoreSpec("order", self.namespace, 0, self.keys, tuple(self.blocks_a))]
        )
        if delayed:
            torch.cuda._sleep(self.delay_cycles)  # the producer is late ...
        for index, (layer, values) in enumerate(zip(self.layers, fresh)):
            layer.copy_(values)  # ... writing the KV the store must wait for
            stores.save_layer(index)
        committed = stores.finish(lambda _: True)
        torch.cuda.synchronize(self.device)
        stored, expected = self._stored_pages(), self._expected_pages(fresh)
        if committed != NUM_PAGES or stored.shape != expected.shape:
            return expected.numel() * 2, expected.numel() * 2
        return expected.numel() * 2, int((stored.view(torch.uint8) != expected.view(torch.uint8)).sum())

    def load(self, worker_name: str, wait: bool) -> tuple[int, int]:
        """Store (ordered), then load into blocks_b with the copy stream delayed; read each layer with or
        without waiting for it. (bytes checked, wrong); also wrong: bytes outside blocks_b touched."""
        fresh = self._fresh()
        for layer, values in zip(self.layers, fresh):
            layer.copy_(values)
        self.client.flush(self.namespace)
        assert (
            self.workers["plain"].store(StoreSpec("src", self.namespace, 0, self.keys, tuple(self.blocks_a)))
            == NUM_PAGES
        )
        lease = self.client.lookup(list(self.keys), LAYOUT.page_bytes)
        refs = tuple(lease.pages)
        C = LAYOUT.chunk_tokens
        spec = LoadSpec("load", self.client.hello.pool_id, 0, refs, self.keys, 0, NUM_PAGES * C, tuple(self.blocks_b))
        for layer in self.layers:
            as_bits(layer).fill_(SENTINEL)
        before = [layer.clone() for layer in self.layers]
        torch.cuda.synchronize(self.device)
        loads = self.workers[worker_name].start_loads([spec], per_layer=True)
        seen = []
        for index, layer in enumerate(self.layers):
            if wait:
                loads.wait_layer(index)
            seen.append(layer.clone())  # what attention on vLLM's stream reads
        outcomes, _ = loads.finish()
        torch.cuda.synchronize(self.device)
        self.client.release([lease.lease_id], wait=True)
        got = torch.stack([reference_gather(s.cpu(), self.paged, 0, NUM_PAGES * C, self.blocks_b) for s in seen])
        want = torch.stack([reference_gather(f.cpu(), self.paged, 0, NUM_PAGES * C, self.blocks_a) for f in fresh])
        wrong = int((as_bits(got).view(torch.uint8) != as_bits(want).view(torch.uint8)).sum())
        if wait:  # the ordered load must also be complete, verified, and touch nothing else
            wrong += 0 if outcomes[0].is_complete else got.numel() * 2
            others = torch.tensor([b for b in range(NUM_BLOCKS) if b not in set(self.blocks_b)])
            for after, original in zip(seen, before):  # every other block still holds the sentinel
                a = self.paged.kv_blocks(as_bits(after)).cpu()[:, others]
                wrong += int((a != self.paged.kv_blocks(as_bits(original)).cpu()[:, others]).sum())
        return got.numel() * 2, wrong


def _result(path: str, kind: str, run) -> PathResult:
    started = time.perf_counter()
    checked, wrong = run()
    detail = f"{100.0 * (checked - wrong) / checked:.1f}% of bytes right" if checked else ""
    return PathResult(path, kind, 1, checked, wrong, time.perf_counter() - started, detail=detail)


def staged_checks(
    client,
    device: torch.device,
    delay_cycles: int = 500_000_000,
    copy_methods: tuple[str, ...] = ("memcpy2d", "torch"),
    orders=MEMORY_ORDERS,
    seed: int = 0,
) -> list[PathResult]:
    """Round trip and ordering checks of the connector's GPU path, per copy method and memory order."""
    results: list[PathResult] = []
    for method in copy_methods:
        for order in orders:
            path = f"vllm-staged/{method} {order}"
            try:
                bench = _Bench(client, order, method, device, delay_cycles, seed)
            except CopyError as exc:
                results.append(PathResult(path, "round_trip", 0, 0, 0, 0.0, skipped=str(exc).split(";")[0]))
                continue
            try:
                results.append(_result(path, "round_trip", lambda: bench.load("plain", wait=True)))
                results.append(_result(f"{path} store-order", "ordering", lambda: bench.store("plain", delayed=True)))
                results.append(
                    _result(f"{path} store-unordered", "control", lambda: bench.store("unordered", delayed=True))
                )
                results.append(_result(f"{path} load-order", "ordering", lambda: bench.load("delayed", wait=True)))
                results.append(_result(f"{path} load-unwaited", "control", lambda: bench.load("delayed", wait=False)))
            finally:
                bench.close()
    return results
