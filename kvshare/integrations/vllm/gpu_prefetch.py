"""On a GPU: the connector's prefetch buffer, where copies ahead of a load land and where the load reads them.

One device tensor of ``prefetch_mib`` MiB, allocated when vLLM registers its KV (beside vLLM's KV budget, as the
staging buffers are), handed out first fit. A run of n pages copied ahead (kvshare.integrations.vllm.prefetch)
takes, per layer group of the pipeline's loads, n rows of that group's bytes, packed as a staging buffer packs
a unit, so a load scatters from it as from staging (kvshare.transfer.pipeline: ``UnitWork.source``)::

    buffer   | run A: g0 rows (n x W0) | g1 rows (n x W1) | ... | run B: g0 rows ... | free |
    stream   H2D run A g0, g1, ... (2-D copies from the registered arena) | event: A's copies ended | H2D run B ..

Where the whole run does not fit, the leading layer groups do (the ones a load waits for first), or the leading
pages of the first group. Only WSUM32 pages are copied ahead: the load sums them on the GPU over the very bytes
it scatters, so a copy ahead is verified as any staged page; an xxh3 page (a CPU writer's, checked on the host
from the arena) ends the run. The copies run on a stream of their own, on the hint listener's thread, under the
pipeline's registration lock, and the pipeline waits for that stream before the arena's registration goes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvshare.integrations.vllm.prefetch import Regions
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.protocol import PageHeader
from kvshare.transfer.pipeline import StagingPipeline
from kvshare.transfer.plan import Unit, plan_unit
from kvshare.transfer.verify import can_sum_staged


@dataclass(eq=False)
class GpuAheadCopy:
    """Pages 0..num_pages-1 of a run, layer groups 0..num_groups-1, in ``regions`` (one per group) once ``done``."""

    num_pages: int
    regions: list[torch.Tensor]
    done: object  # torch.cuda.Event recorded after the copies
    owner: GpuAhead
    start: int

    @property
    def num_groups(self) -> int:
        return len(self.regions)

    def is_done(self) -> bool:
        return self.done.query()

    def release(self) -> None:
        self.owner.free(self.start)

    def source(self, group: int, first: int, num_pages: int) -> torch.Tensor:
        """Group ``group``'s rows of pages ``first .. first + num_pages - 1``, packed as a staged unit."""
        row = self.regions[group].numel() // self.num_pages
        return self.regions[group][first * row : (first + num_pages) * row]


ALIGN = 256  # bytes: every region of the buffer starts at a multiple of this


class GpuAhead:
    """The prefetch buffer of one GPU worker and the stream its copies ahead run on (prefetch.DeviceAhead)."""

    def __init__(self, pipeline: StagingPipeline, kv_layout: KVLayout, num_bytes: int) -> None:
        self.pipeline, self.kv_layout = pipeline, kv_layout
        device = pipeline.device
        with torch.cuda.device(device):
            self.buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
            self.stream = torch.cuda.Stream(device)
        pipeline.ahead_streams.append(self.stream)
        self.num_bytes = num_bytes
        self._regions = Regions(num_bytes)
        self._lock = threading.Lock()
        # 2-D copies only (the torch copier reads through the client's own mapping); WSUM32 summed on the GPU
        self.is_usable = pipeline.copier.name == "memcpy2d" and can_sum_staged(kv_layout)
        self._rows = [(l1 - l0) * kv_layout.layer_bytes for l0, l1 in pipeline.load_groups]

    def free(self, start: int) -> None:
        with self._lock:
            self._regions.free(start)

    def room(self) -> int:
        with self._lock:
            return self._regions.largest() // ALIGN * ALIGN

    def wanted(self, pages: Sequence[PageHeader]) -> int:
        return min(_leading_wsum32(pages) * sum(self._rows), self.num_bytes)

    def copy_ahead(self, client, pages: Sequence[PageHeader]) -> GpuAheadCopy | None:
        """Copies from the arena this pipeline registered (the hooks' thread's mapping of ``client``'s pool)."""
        if not self.is_usable:
            return None
        n = _leading_wsum32(pages)
        with self._lock:
            n, k = fitting(n, self._rows, self._regions.largest() // ALIGN * ALIGN)
            # regions start ALIGN-aligned: the scatter views the rows as integers up to 8 bytes wide
            start = self._regions.allocate(-(-n * sum(self._rows[:k]) // ALIGN) * ALIGN) if n else None
        if start is None:
            return None
        try:
            offsets = [page.offset for page in pages[:n]]
            return self._enqueue(client.hello.pool_id, offsets, k, start, client.hello.extent_bytes)
        except BaseException:
            self.free(start)
            raise

    def _enqueue(self, pool_id: bytes, offsets: list[int], k: int, start: int, extent_bytes) -> GpuAheadCopy | None:
        n, pipeline = len(offsets), self.pipeline
        regions, at = [], start
        for row in self._rows[:k]:
            regions.append(self.buffer[at : at + n * row])
            at += n * row
        units: list[Unit] = [
            plan_unit(offsets, self.kv_layout, pipeline.load_groups[g], (0, n), extent_bytes) for g in range(k)
        ]
        done = torch.cuda.Event()
        with pipeline.registration_lock:
            if pipeline.registered_pool_id != pool_id:  # not the arena registered now (a restarted pool)
                self.free(start)
                return None
            with torch.cuda.device(pipeline.device), torch.inference_mode():
                pipeline.prefetch(None, units, regions, self.stream)
                done.record(self.stream)
        return GpuAheadCopy(n, regions, done, self, start)


def _leading_wsum32(pages: Sequence[PageHeader]) -> int:
    """How many leading pages a GPU writer summed (WSUM32): the load verifies those over the bytes it scatters."""
    return next((i for i, page in enumerate(pages) if page.checksum_kind != ChecksumKind.WSUM32), len(pages))


def fitting(num_pages: int, rows: list[int], space: int) -> tuple[int, int]:
    """(pages, layer groups) of a run of ``num_pages`` to copy ahead into ``space`` bytes: every page of as many
    leading groups as fit, else as many leading pages of the first group (rows: each group's bytes per page)."""
    k, used = 0, 0
    while k < len(rows) and used + num_pages * rows[k] <= space:
        used += num_pages * rows[k]
        k += 1
    if k:
        return num_pages, k
    n = min(num_pages, space // rows[0]) if rows else 0
    return n, 1 if n else 0
