"""CudaTransfer: registered pool pages <-> a GPU KV tensor, through GPU staging buffers.

Two side streams and ``staging_buffers`` staging buffers (default two: double buffering)::

    load   copy stream:     H2D unit0 -> buf0 | H2D unit1 -> buf1 | H2D unit2 -> buf0 (after scatter0) ...
           reshape stream:        scatter+WSUM32 buf0 -> kv | scatter+WSUM32 buf1 -> kv | ...   event per layer group
    store  producer stream: ... kernels writing kv | event
           reshape stream:  (waits on it) gather kv -> buf0, WSUM32 | gather kv -> buf1, WSUM32 | ...
           copy stream:           D2H buf0 -> pages | D2H buf1 -> pages | ... event per page block

A unit is a group of layers (a page row of >= min_copy_bytes; a load's last layer alone) over a block of
pages; each run of consecutive pages in it is one 2-D copy (plan.py). The
reshape (token/head transpose) runs on the GPU at HBM speed. Every dependency
is an explicit event: a store's copies never start before the producer's
event; a load's scatter never starts before the caller's earlier work on kv;
the compute stream reads layer l only after ``wait_layer(l)``.

Checksums (kvshare.transfer.verify): a store sums WSUM32 of the staged bytes on the GPU and commits it;
a load checks each chosen page by its recorded kind beside the copies (WSUM32 on the GPU from the staged
bytes, XXH3 on host threads) and reports a bad page in ``verify()``, after the reader used the KV: the
caller computes again from that page. The host never waits for a checksum before the forward.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch

from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.wsum import add_rows, as_unsigned
from kvshare.transfer.base import LAZY_GROUPS_AHEAD, ChunkChecksumMismatch, KVTransfer, LoadHandle, TransferConfig
from kvshare.transfer.copiers import make_copier
from kvshare.transfer.layouts import as_bits, chunks_to_engine, chunks_view, engine_to_chunks
from kvshare.transfer.plan import Unit, last_layer_alone, layer_groups, load_units, pages_per_unit, store_units
from kvshare.transfer.registration import acquire_registration, release_registration
from kvshare.transfer.verify import PageCheck, can_sum_staged, store_checksum_kind

class CudaLoadHandle(LoadHandle):
    """A load in flight: one event per layer group on the reshape stream.

    Its copies are enqueued group by group by ``steps`` (a generator that yields after each
    group), at once ("eager"), ahead of the reader's wait_layer ("lazy"), or the first group by
    the caller and the rest by a thread ("thread"). ``wait_layer`` makes sure the group's event
    has been recorded before the compute stream waits on it (waiting on an event not yet
    recorded would not wait at all).
    """

    def __init__(self, num_bytes: int, group_of_layer: list[int], num_groups: int, device, mode: str,
                 check: PageCheck, first_chunk: int, pages: Sequence, check_stream) -> None:
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
    """Copies between the registered arena and a CUDA ``kv [L, 2, H, T, D]``. One caller at a time."""

    def __init__(self, layout, client, device, config: TransferConfig) -> None:
        super().__init__(layout, client, device, config)
        if not torch.cuda.is_available():
            raise RuntimeError("CudaTransfer needs CUDA, and torch.cuda.is_available() is False here")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._copier = make_copier(config.copy_method, self.device.index)  # fails before anything is pinned
        groups = layer_groups(layout.num_layers, layout.layer_bytes, config.min_copy_bytes)  # a store's
        self._groups = last_layer_alone(groups)  # a load's: the last layer alone, only its compute after the last copy
        widest = max(l1 - l0 for l0, l1 in groups) * layout.layer_bytes
        pages_per_unit(config.staging_bytes, widest)  # refuses a staging buffer that cannot hold one row
        self._group_of_layer = [g for g, (l0, l1) in enumerate(self._groups) for _ in range(l0, l1)]
        self.registration = acquire_registration(client)
        self.registration_seconds = self.registration.seconds
        try:
            with torch.cuda.device(self.device):
                # high priority: a load's scatter kernels get SMs ahead of long compute kernels, so the copy
                # pipeline (two staging buffers) does not stall behind the compute it overlaps (torch maps -1
                # to the device's highest priority)
                self._copy_stream = torch.cuda.Stream(self.device, priority=-1)
                self._reshape_stream = torch.cuda.Stream(self.device, priority=-1)
                self._staging = [torch.empty(config.staging_bytes, dtype=torch.uint8, device=self.device)
                                 for _ in range(config.staging_buffers)]
                self._idle = [torch.cuda.Event() for _ in range(config.staging_buffers)]  # last use of each staging buffer
        except BaseException:
            release_registration(self.registration)
            raise
        self._next_buffer = 0
        self._closed = False
        self._pending: CudaLoadHandle | None = None  # a load whose copies may not all be enqueued yet
        self.last_store_copy_seconds: float | None = None  # GPU time of the last store's gathers and copies
        self.checksum_kind = store_checksum_kind(layout, is_staged=True)  # WSUM32, summed here over the staged bytes

    # -- the interface ------------------------------------------------------------------------------

    @torch.inference_mode()  # kv may be an inference tensor (allocated under inference mode)
    def load(self, kv: torch.Tensor, first_chunk: int, pages: Sequence) -> LoadHandle:
        offsets = self._page_offsets(pages)
        self._check_kv(kv, first_chunk, len(offsets))
        self._check_open(kv)
        if not offsets:
            return LoadHandle(num_bytes=0, seconds=0.0)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self._reshape_stream.wait_event(ready)  # the scatter writes kv only after the caller's earlier work on it
        kv.record_stream(self._reshape_stream)
        with torch.cuda.stream(self._reshape_stream):  # its sums accumulate there, after each copy lands
            # pages are leased and immutable: XXH3 ones are hashed on host threads while the copies run
            check = PageCheck(pages, self._pages_to_verify(len(offsets)), self.client, self._hasher, self.device,
                              on_device=can_sum_staged(self.layout))
        handle = CudaLoadHandle(len(offsets) * self.layout.page_bytes, self._group_of_layer, len(self._groups),
                                self.device, self.config.load_enqueue, check, first_chunk, pages, self._reshape_stream)
        self._pending = handle
        handle.begin(self._load_steps(kv, first_chunk, offsets, handle))
        if handle._mode == "eager" and handle._error is not None:
            raise handle._error
        return handle

    def _load_steps(self, kv: torch.Tensor, first_chunk: int, offsets: list[int], handle: CudaLoadHandle):
        """Plan and enqueue a load's copies and scatters, yielding after each layer group is recorded.

        Never raises: an error goes to the handle (wait_layer raises it). The end event is recorded
        after whatever was enqueued, when the steps run out, fail, or are closed."""
        cfg, copy, reshape = self.config, self._copy_stream, self._reshape_stream
        kv_bits = as_bits(kv)
        try:
            # inference mode and the device are thread-local, and entered per group: never held across a
            # yield, which would leak them into the reader's code between groups ("lazy")
            with torch.inference_mode(), torch.cuda.device(self.device):
                handle.start.record(copy)
                if cfg.load_delay_cycles:
                    with torch.cuda.stream(copy):
                        torch.cuda._sleep(cfg.load_delay_cycles)
            plan = load_units(offsets, self.layout, cfg.min_copy_bytes, cfg.staging_bytes, self.extent_bytes, self._groups)
            for group, units in enumerate(plan):
                with torch.inference_mode(), torch.cuda.device(self.device):
                    for unit in units:
                        buf = self._take_buffer()
                        copy.wait_event(self._idle[buf])  # the previous scatter out of this buffer is done
                        self._host_copies(unit, buf, copy, to_device=True)
                        if handle.first_copy_s is None:
                            handle.first_copy_s = time.perf_counter()
                        copied = torch.cuda.Event()
                        copied.record(copy)
                        reshape.wait_event(copied)
                        with torch.cuda.stream(reshape):
                            layers = kv_bits[unit.layer_start : unit.layer_stop]
                            chunks_to_engine(layers, self._chunks(buf, unit), self._first_token(first_chunk, unit))
                            if handle.check.needs_staged_sums:
                                handle.check.add_staged(unit.page_start, unit.page_stop, *self._rows(buf, unit))
                        self._idle[buf].record(reshape)
                    handle.record_group(group, reshape)
                yield group
        except Exception as exc:  # noqa: BLE001 - handed to the reader through the handle
            handle.enqueue_failed(exc)
        finally:
            last = torch.cuda.Event()
            last.record(copy)
            reshape.wait_event(last)
            handle.end.record(reshape)

    @torch.inference_mode()
    def store(self, kv: torch.Tensor, first_chunk: int, offsets: Sequence[int], producer_stream=None) -> list[int]:
        offsets = list(offsets)
        self._check_kv(kv, first_chunk, len(offsets))
        self._check_open(kv)
        if not offsets:
            return []
        cfg, copy, reshape = self.config, self._copy_stream, self._reshape_stream
        producer = producer_stream if producer_stream is not None else torch.cuda.current_stream(self.device)
        produced = torch.cuda.Event()
        produced.record(producer)
        self._order_after_producer(reshape, produced)
        kv.record_stream(reshape)
        kv_bits = as_bits(kv)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(reshape)
        on_device = self.checksum_kind == ChecksumKind.WSUM32
        if on_device:
            with torch.cuda.stream(reshape):
                sums = torch.zeros(len(offsets), dtype=torch.int64, device=self.device)  # WSUM32 per page
        blocks = []
        for units in store_units(offsets, self.layout, cfg.min_copy_bytes, cfg.staging_bytes, self.extent_bytes):
            for unit in units:
                buf = self._take_buffer()
                reshape.wait_event(self._idle[buf])  # the previous copy out of this buffer is done
                with torch.cuda.stream(reshape):
                    layers = kv_bits[unit.layer_start : unit.layer_stop]
                    engine_to_chunks(self._chunks(buf, unit), layers, self._first_token(first_chunk, unit))
                    if on_device:  # the staged bytes, which the copy below writes to the pages
                        add_rows(sums[unit.page_start : unit.page_stop], *self._rows(buf, unit))
                gathered = torch.cuda.Event()
                gathered.record(reshape)
                copy.wait_event(gathered)
                self._host_copies(unit, buf, copy, to_device=False)
                self._idle[buf].record(copy)
            block_done = torch.cuda.Event()
            block_done.record(copy)
            blocks.append((units[0].page_start, units[0].page_stop, block_done))
        end.record(copy)
        checksums: list[int] = []
        if on_device:
            end.synchronize()
            with torch.cuda.stream(reshape):  # read back on our idle stream, not behind the compute
                checksums = as_unsigned(sums)
        for p0, p1, block_done in [] if on_device else blocks:  # hash each block once copied, while later ones run
            block_done.synchronize()
            checksums.extend(self._hasher.checksums([self._page(offset) for offset in offsets[p0:p1]]))
        end.synchronize()
        self.last_store_copy_seconds = start.elapsed_time(end) / 1e3
        return checksums

    def inject_producer_delay(self, stream=None) -> None:
        if self.config.producer_delay_cycles:
            with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(self.device)):
                torch.cuda._sleep(self.config.producer_delay_cycles)

    def sync(self) -> None:
        if not self._closed:
            self._join_enqueue()
            self._reshape_stream.synchronize()
            self._copy_stream.synchronize()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._join_enqueue()
        self._copy_stream.synchronize()
        self._reshape_stream.synchronize()
        self._staging = []
        try:
            release_registration(self.registration)
        finally:
            super().close()

    # -- internals ----------------------------------------------------------------------------------

    def _join_enqueue(self) -> None:
        """Finish enqueueing the last load: staging buffers and their events are shared."""
        if self._pending is not None:
            self._pending.finish_enqueue()
            self._pending = None

    def _order_after_producer(self, stream, produced) -> None:
        """The store's first read of kv waits for the producer: the dependency the study's bug lacked."""
        stream.wait_event(produced)

    def _check_open(self, kv: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("this CudaTransfer is closed")
        self._join_enqueue()  # staging buffers and their events are shared with a load still being enqueued
        if kv.device != self.device:
            raise ValueError(f"kv is on {kv.device}, this transfer serves {self.device}")

    def _take_buffer(self) -> int:
        buf = self._next_buffer
        self._next_buffer = (buf + 1) % len(self._idle)
        return buf

    def _rows(self, buf: int, unit: Unit) -> tuple[torch.Tensor, int]:
        """The unit's staged pages as int32 words ``[n, W]`` and where they start in each page, in words."""
        rows = self._staging[buf][: unit.num_bytes].view(torch.int32).view(unit.num_pages, -1)
        return rows, unit.layer_start * self.layout.layer_bytes // 4

    def _chunks(self, buf: int, unit: Unit) -> torch.Tensor:
        return chunks_view(self._staging[buf], self.layout, unit.num_pages, unit.num_layers)  # [n, g, 2, C, H, D]

    def _first_token(self, first_chunk: int, unit: Unit) -> int:
        return (first_chunk + unit.page_start) * self.layout.chunk_tokens

    def _host_copies(self, unit: Unit, buf: int, stream, to_device: bool) -> None:
        for c in unit.copies:
            self.registration.check_span(c.host_offset, (c.height - 1) * c.host_pitch + c.width)
        self._copier.copy(unit.copies, self.client, self.registration.base_ptr, self._staging[buf], stream, to_device)
