"""CUDA paths of the byte check: round trips over the registered arena, and ordering under imposed delay.

The study's worst bug was a copy that did not depend on the producer's stream:
it read KV before the kernel writing it had run, and committed plausible but
wrong bytes. A checksum cannot see that (the writer hashes what it copied), and
without a delay the race is usually won by luck. So, per copy method:

- store-order: the producer stream sleeps, then writes the KV; store() with
  the producer's stream must still copy the new bytes (exact). The *control*
  is the same store with the dependency removed (``UnorderedStoreTransfer``):
  it must come out wrong, proving the check can see this class of bug.
- load-order: the copy stream sleeps before its copies; a consumer that calls
  ``wait_layer`` before reading must see the loaded bytes (exact); the control
  reads without waiting and must see the old ones.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from kvshare.pool.protocol import PageHeader
from kvshare.transfer.base import TransferConfig
from kvshare.transfer.copiers import CopyError
from kvshare.transfer.cuda import CudaTransfer
from kvshare.transfer.layouts import as_bits, engine_to_chunks
from kvshare.transfer.pipeline import StagingPipeline
from kvshare.transfer.roundtrip import PathResult, mismatched_bytes, random_kv, round_trip, sentinel_kv

ORDER_PAGES = 8


class UnorderedPipeline(StagingPipeline):
    """DELIBERATELY BROKEN (validation control only): a store does not wait for the producer's event."""

    def order_after_producer(self, stream, produced) -> None:
        pass


class UnorderedStoreTransfer(CudaTransfer):
    """DELIBERATELY BROKEN (validation control only): the store does not wait for the producer's event."""

    pipeline_class = UnorderedPipeline


def _percent_right(checked: int, wrong: int) -> str:
    return f"{100.0 * (checked - wrong) / checked:.1f}% of bytes right" if checked else ""


def store_order(transfer: CudaTransfer, client, offsets: list[int], seed: int) -> tuple[int, int]:
    """Producer sleeps, then writes kv; store right after. (bytes checked, bytes wrong in the pages)."""
    lay, device = transfer.layout, transfer.device
    n = len(offsets)
    data = random_kv(lay, n * lay.chunk_tokens, seed, device)
    expected = torch.empty(
        (n, lay.num_layers, 2, lay.chunk_tokens, lay.num_kv_heads, lay.head_dim),
        dtype=as_bits(data).dtype,
        device=device,
    )
    engine_to_chunks(expected, as_bits(data), 0)
    kv = torch.zeros_like(data)
    torch.cuda.synchronize(device)
    producer = torch.cuda.Stream(device)
    transfer.inject_producer_delay(producer)  # the producer is late ...
    with torch.cuda.stream(producer):
        kv.copy_(data)  # ... writing the KV that store() must wait for
    transfer.store(kv, 0, offsets, producer_stream=producer)
    stored = np.concatenate([client.page(o, lay.page_bytes) for o in offsets])  # read before the producer may finish
    producer.synchronize()
    wrong = int((stored != expected.cpu().view(torch.uint8).reshape(-1).numpy()).sum())
    return stored.size, wrong


def load_order(
    transfer: CudaTransfer, offsets: list[int], sums: list[int], data: torch.Tensor, wait: bool
) -> tuple[int, int]:
    """Copy stream sleeps before copying; the consumer reads kv with or without wait_layer."""
    lay, device = transfer.layout, transfer.device
    dst = sentinel_kv(lay, len(offsets) * lay.chunk_tokens, device)
    torch.cuda.synchronize(device)
    headers = [
        PageHeader(offset=o, page_bytes=lay.page_bytes, checksum=s, checksum_kind=transfer.checksum_kind)
        for o, s in zip(offsets, sums)
    ]
    handle = transfer.load(dst, 0, headers)
    if wait:
        for layer in range(lay.num_layers):
            handle.wait_layer(layer)
    seen = dst.clone()  # what attention on the current stream would read
    handle.wait_all()
    torch.cuda.synchronize(device)
    return seen.numel() * seen.element_size(), mismatched_bytes(seen, data)


def _result(path: str, kind: str, run) -> PathResult:
    start = time.perf_counter()
    checked, wrong = run()
    return PathResult(path, kind, 1, checked, wrong, time.perf_counter() - start, detail=_percent_right(checked, wrong))


def cuda_checks(
    client, cases, offsets: list[int], config, tconfig: TransferConfig, device: torch.device
) -> list[PathResult]:
    """Round trip and ordering checks for every configured copy method on ``device``."""
    results: list[PathResult] = []
    order_offsets = offsets[:ORDER_PAGES]
    delays = dict(producer_delay_cycles=config.delay_cycles, load_delay_cycles=config.delay_cycles)
    for method in config.copy_methods:
        path = f"cuda/{method}"
        plain_config = dataclasses.replace(tconfig, copy_method=method)
        try:
            plain = CudaTransfer(config.layout, client, device, plain_config)
        except CopyError as exc:
            results.append(PathResult(path, "round_trip", 0, 0, 0, 0.0, skipped=str(exc).split(";")[0]))
            continue
        delayed = CudaTransfer(config.layout, client, device, dataclasses.replace(plain_config, **delays))
        unordered = UnorderedStoreTransfer(config.layout, client, device, dataclasses.replace(plain_config, **delays))
        try:
            results.append(_result(path, "round_trip", lambda: round_trip(plain, client, cases, config, device)))
            results.append(
                _result(
                    f"{path} store-order", "ordering", lambda: store_order(delayed, client, order_offsets, config.seed)
                )
            )
            results.append(
                _result(
                    f"{path} store-unordered",
                    "control",
                    lambda: store_order(unordered, client, order_offsets, config.seed + 1),
                )
            )
            data = random_kv(config.layout, len(order_offsets) * config.layout.chunk_tokens, config.seed + 2, device)
            sums = plain.store(data, 0, order_offsets)
            results.append(
                _result(
                    f"{path} load-order", "ordering", lambda: load_order(delayed, order_offsets, sums, data, wait=True)
                )
            )
            results.append(
                _result(
                    f"{path} load-unwaited",
                    "control",
                    lambda: load_order(delayed, order_offsets, sums, data, wait=False),
                )
            )
        finally:
            for transfer in (unordered, delayed, plain):
                transfer.close()
    return results
