"""CudaTransfer: registered pool pages <-> the built-in engine's GPU KV tensor, through the staging pipeline.

The streams, staging buffers, registration and both loops are kvshare.transfer.pipeline's (one lane,
``staging_buffers`` buffers shared by loads and stores); this module supplies the engine's layout
(``layouts.EngineKV``: kv ``[L, 2, H, T, D]``, chunk j = tokens ``[j*C, (j+1)*C)``) and its call order::

    load   copy stream:     H2D unit0 -> buf0 | H2D unit1 -> buf1 | H2D unit2 -> buf0 (after scatter0) ...
           reshape stream:        scatter+WSUM32 buf0 -> kv | scatter+WSUM32 buf1 -> kv | ...   event per layer group
    store  producer stream: ... kernels writing kv | event
           reshape stream:  (waits on it) gather kv -> buf0, WSUM32 | gather kv -> buf1, WSUM32 | ...
           copy stream:           D2H buf0 -> pages | D2H buf1 -> pages | ... event per page block

A load's layer groups put the last layer alone (plan.last_layer_alone); its copies are enqueued group
by group at once ("eager"), ahead of the reader's wait_layer ("lazy") or by a thread ("thread"). Every
dependency is an explicit event: a store's copies never start before the producer's event; a load's
scatter never starts before the caller's earlier work on kv; the compute stream reads layer l only after
``wait_layer(l)``.

Checksums (kvshare.transfer.verify): a store sums WSUM32 of the staged bytes on the GPU and commits it;
a load checks each chosen page by its recorded kind beside the copies (WSUM32 on the GPU from the staged
bytes, XXH3 on host threads) and reports a bad page in ``verify()``, after the reader used the KV: the
caller computes again from that page. The host never waits for a checksum before the forward.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.wsum import as_unsigned
from kvshare.transfer.base import LAZY_GROUPS_AHEAD, ChunkChecksumMismatch, KVTransfer, LoadHandle, TransferConfig
from kvshare.transfer.layouts import EngineKV, as_bits
from kvshare.transfer.pipeline import StagingPipeline, UnitWork
from kvshare.transfer.plan import last_layer_alone, layer_groups, store_units
from kvshare.transfer.state import StateLoad, cuda_load_state, cuda_store_state
from kvshare.transfer.verify import PageCheck, can_sum_staged, store_checksum_kind


class CudaLoadHandle(LoadHandle):
    """A load in flight: one event per layer group on the reshape stream.

    Its copies are enqueued group by group by ``steps`` (a generator that yields after each
    group), at once ("eager"), ahead of the reader's wait_layer ("lazy"), or the first group by
    the caller and the rest by a thread ("thread"). ``wait_layer`` makes sure the group's event
    has been recorded before the compute stream waits on it (waiting on an event not yet
    recorded would not wait at all).
    """

    def __init__(
        self,
        num_bytes: int,
        group_of_layer: list[int],
        num_groups: int,
        device,
        mode: str,
        check: PageCheck,
        first_chunk: int,
        pages: Sequence,
        check_stream,
    ) -> None:
        super().__init__(num_bytes)
        self.check = check  # the chosen pages' checksums, computed beside the copies (kvshare.transfer.verify)
        self._first_chunk, self._pages, self._check_stream = first_chunk, list(pages), check_stream
        self._group_of_layer = group_of_layer
        self._group_events = [torch.cuda.Event() for _ in range(num_groups)]
        self._recorded = [threading.Event() for _ in range(num_groups)]
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._device = device
        self._mode = mode
        self._steps = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def begin(self, steps) -> None:
        """Start enqueueing: ``steps`` records this handle's groups one by one as it is advanced."""
        self._steps = steps
        num_groups = len(self._recorded)
        if self._mode == "eager":
            self._advance(num_groups)
        elif self._mode == "lazy":
            self._advance(LAZY_GROUPS_AHEAD)
        else:
            # the first group here, by the caller: a thread started now gets the GIL only once the
            # reader blocks in its first wait_layer, which delayed the first copy by 1.4-4.7 ms
            self._advance(1)
            self._thread = threading.Thread(target=self._advance, args=(num_groups,), name="kvshare-load", daemon=True)
            self._thread.start()

    def _advance(self, num_groups: int) -> None:
        """Enqueue groups until the first ``num_groups`` are recorded; all of them: until the steps end
        (which records ``end``), or the enqueue failed."""
        while self._steps is not None:
            if num_groups < len(self._recorded) and all(r.is_set() for r in self._recorded[:num_groups]):
                return
            if next(self._steps, None) is None:
                self._steps = None

    def copy_started(self, when: float) -> None:
        self.first_copy_s = when

    def record_group(self, group: int, stream) -> None:
        self._group_events[group].record(stream)
        self._recorded[group].set()

    def enqueue_failed(self, error: BaseException) -> None:
        self._error = error
        for recorded in self._recorded:  # wake every waiter; wait_layer raises the error
            recorded.set()

    def wait_layer(self, layer: int) -> None:
        group = self._group_of_layer[layer]
        if self._mode == "lazy":
            self._advance(min(len(self._recorded), group + 1 + LAZY_GROUPS_AHEAD))
        self._recorded[group].wait()
        if self._error is not None:
            raise RuntimeError(f"the pool load could not be enqueued: {self._error}") from self._error
        torch.cuda.current_stream(self._device).wait_event(self._group_events[group])

    def finish_enqueue(self) -> None:
        """Every copy enqueued (the thread joined): the transfer may be used again."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._advance(len(self._recorded))

    def wait_all(self) -> None:
        self.finish_enqueue()
        self.end.synchronize()  # recorded after whatever was enqueued, also when the enqueue failed
        if self.seconds is None and self._error is None:
            self.seconds = self.start.elapsed_time(self.end) / 1e3

    def verify(self) -> None:
        self.wait_all()
        if self._error is not None:  # wait_layer raised it already; no page was checked
            return
        with torch.cuda.stream(self._check_stream):  # read back on our idle stream, not behind the compute
            bad = self.check.bad_pages()
        if bad:
            raise ChunkChecksumMismatch(self._first_chunk + bad[0], self._pages[bad[0]].offset)


class CudaTransfer(KVTransfer):
    """Copies between the registered arena and a CUDA ``kv [L, 2, H, T, D]`` through the staging pipeline
    (kvshare.transfer.pipeline), one lane for loads and stores. One caller at a time."""

    pipeline_class = StagingPipeline  # the validation's deliberately unordered control replaces it

    def __init__(self, layout, client, device, config: TransferConfig) -> None:
        super().__init__(layout, client, device, config)
        if not torch.cuda.is_available():
            raise RuntimeError("CudaTransfer needs CUDA, and torch.cuda.is_available() is False here")
        groups = layer_groups(layout.num_layers, layout.layer_bytes, config.min_copy_bytes)  # a store's
        # a load's: the last layer alone, so only its compute is left after the load's last copy
        self.pipeline = self.pipeline_class(
            layout, config, self.device, shared_lane=True, load_groups=last_layer_alone(groups)
        )
        self.device = self.pipeline.device
        try:
            self.pipeline.ensure_registered(client)
        except BaseException:
            self.pipeline.close()
            raise
        self.registration_seconds = self.registration.seconds
        self._closed = False
        self._pending: CudaLoadHandle | None = None  # a load whose copies may not all be enqueued yet
        self.last_store_copy_seconds: float | None = None  # GPU time of the last store's gathers and copies
        self.checksum_kind = store_checksum_kind(layout, is_staged=True)  # WSUM32, summed here over the staged bytes
        self.state_checksum_kind = ChecksumKind.WSUM32  # a checkpoint is whole 64-byte blocks, summed on the device

    @property
    def registration(self):
        """The arena's CUDA registration this transfer holds (shared by the process, by base address)."""
        return self.pipeline.registration

    # -- the interface ------------------------------------------------------------------------------

    @torch.inference_mode()  # kv may be an inference tensor (allocated under inference mode)
    def load(self, kv: torch.Tensor, first_chunk: int, pages: Sequence) -> LoadHandle:
        offsets = self._page_offsets(pages)
        self._check_kv(kv, first_chunk, len(offsets))
        self._check_open(kv)
        if not offsets:
            return LoadHandle(num_bytes=0, seconds=0.0)
        pipeline = self.pipeline
        reshape = pipeline.load_lane.reshape
        pipeline.load_after(torch.cuda.current_stream(self.device))  # after the caller's earlier work on kv
        kv.record_stream(reshape)
        with torch.cuda.stream(reshape):  # its sums accumulate there, after each copy lands
            # pages are leased and immutable: XXH3 ones are hashed on host threads while the copies run
            check = PageCheck(
                pages,
                self._pages_to_verify(len(offsets)),
                self.client,
                self._hasher,
                self.device,
                on_device=can_sum_staged(self.layout),
            )
        handle = CudaLoadHandle(
            len(offsets) * self.layout.page_bytes,
            pipeline.group_of_layer,
            len(pipeline.load_groups),
            self.device,
            self.config.load_enqueue,
            check,
            first_chunk,
            pages,
            reshape,
        )
        self._pending = handle
        handle.begin(
            pipeline.load_steps(
                self.client,
                self._load_work(kv, first_chunk, offsets, check),
                handle.start,
                handle.end,
                handle.record_group,
                handle.enqueue_failed,
                handle.copy_started,
            )
        )
        if handle._mode == "eager" and handle._error is not None:
            raise handle._error
        return handle

    def _load_work(self, kv: torch.Tensor, first_chunk: int, offsets: list[int], check: PageCheck):
        """A load's units per layer group (planned lazily, as the groups are enqueued), into ``kv``."""
        destination = EngineKV(as_bits(kv), first_chunk, self.layout.chunk_tokens)
        for units in self.pipeline.plan_groups(offsets, self.extent_bytes):
            yield [UnitWork(unit, destination, check.staged_sums(unit.page_start, unit.page_stop)) for unit in units]

    @torch.inference_mode()
    def store(self, kv: torch.Tensor, first_chunk: int, offsets: Sequence[int], producer_stream=None) -> list[int]:
        offsets = list(offsets)
        self._check_kv(kv, first_chunk, len(offsets))
        self._check_open(kv)
        if not offsets:
            return []
        cfg, pipeline = self.config, self.pipeline
        lane = pipeline.store_lane
        pipeline.store_after(producer_stream if producer_stream is not None else torch.cuda.current_stream(self.device))
        kv.record_stream(lane.reshape)
        destination = EngineKV(as_bits(kv), first_chunk, self.layout.chunk_tokens)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(lane.reshape)
        on_device = self.checksum_kind == ChecksumKind.WSUM32
        if on_device:
            with torch.cuda.stream(lane.reshape):
                sums = torch.zeros(len(offsets), dtype=torch.int64, device=self.device)  # WSUM32 per page
        blocks = []
        for units in store_units(offsets, self.layout, cfg.min_copy_bytes, cfg.staging_bytes, self.extent_bytes):
            pipeline.store_steps(
                self.client,
                [
                    UnitWork(unit, destination, sums[unit.page_start : unit.page_stop] if on_device else None)
                    for unit in units
                ],
            )
            block_done = torch.cuda.Event()
            block_done.record(lane.copy)
            blocks.append((units[0].page_start, units[0].page_stop, block_done))
        end.record(lane.copy)
        checksums: list[int] = []
        if on_device:
            end.synchronize()
            with torch.cuda.stream(lane.reshape):  # read back on our idle stream, not behind the compute
                checksums = as_unsigned(sums)
        for p0, p1, block_done in [] if on_device else blocks:  # hash each block once copied, while later ones run
            block_done.synchronize()
            checksums.extend(self._hasher.checksums([self._page(offset) for offset in offsets[p0:p1]]))
        end.synchronize()
        self.last_store_copy_seconds = start.elapsed_time(end) / 1e3
        return checksums

    @torch.inference_mode()
    def load_state(self, page, into: torch.Tensor) -> StateLoad:
        self._check_open(into)
        return cuda_load_state(self.pipeline, self.client, self._hasher, page, into, bool(self._pages_to_verify(1)))

    @torch.inference_mode()
    def store_state(self, data: torch.Tensor, offset: int, producer_stream=None) -> int:
        self._check_open(data)
        return cuda_store_state(self.pipeline, self.client, data, offset, producer_stream)

    def inject_producer_delay(self, stream=None) -> None:
        if self.config.producer_delay_cycles:
            with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(self.device)):
                torch.cuda._sleep(self.config.producer_delay_cycles)

    def sync(self) -> None:
        if not self._closed:
            self._join_enqueue()
            self.pipeline.sync()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._join_enqueue()
        try:
            self.pipeline.close()  # waits for every copy, then releases the registration
        finally:
            super().close()

    # -- internals ----------------------------------------------------------------------------------

    def _join_enqueue(self) -> None:
        """Finish enqueueing the last load: staging buffers and their events are shared."""
        if self._pending is not None:
            self._pending.finish_enqueue()
            self._pending = None

    def _check_open(self, kv: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("this CudaTransfer is closed")
        self._join_enqueue()  # staging buffers and their events are shared with a load still being enqueued
        if kv.device != self.device:
            raise ValueError(f"kv is on {kv.device}, this transfer serves {self.device}")
