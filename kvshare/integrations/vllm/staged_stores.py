"""A step's stores on a GPU: each layer group copied out right after the kernels that wrote it, committed after.

vLLM calls ``save_kv_layer(l)`` after attention layer l wrote its KV. Per group of layers (staging
draws the groups), once its last layer was saved::

    vLLM stream    |-- layer l --| event (recorded here, after the kernels that wrote the layer)
    store reshape       (waits for it) gather blocks -> staging, WSUM32 of the staged pages
    store copy                 (waits for the gather) D2H staging -> reserved pages

The pages are reserved at the step's first saved layer (one pool round trip while vLLM's kernels
run). ``finish`` (wait_for_save) enqueues any group never saved (a forward without the hooks: then
after the whole forward), makes vLLM's stream wait for the last gather (vLLM may hand the blocks to
another request once the step ends; our reads of them must come first), waits for the store's end
event and commits each request's pages with their WSUM32 checksums, or aborts them where the step
computed from KV that failed to load. A page is visible only after its commit, and never holds a
partial copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from kvshare.integrations.vllm.metadata import PhaseTimes, StoreSpec
from kvshare.integrations.vllm.staging import Segment, StagingEngine, gather_staged
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind
from kvshare.transfer.plan import Unit
from kvshare.transfer.wsum import add_rows, as_unsigned

log = logging.getLogger("kvshare.integrations")


class StorePool(Protocol):
    """What the stores need to reserve, commit and abort pages (pool_pages.PoolPages is one)."""

    kv_layout: KVLayout

    def reserve(self, client, spec: StoreSpec, times: PhaseTimes): ...

    def commit(self, client, spec: StoreSpec, reservation, checksums: list[int], kind: ChecksumKind,
               times: PhaseTimes) -> int: ...

    def abort(self, client, reservation_id: int, exc: BaseException | None) -> None: ...


@dataclass
class _StorePlan:
    spec: StoreSpec
    reservation: object  # kvshare.pool.client.Reservation
    units: list[list[Unit]]  # per layer group
    slots: tuple  # (block, slot) per token of each granted page, [n, C] each, on the device
    base: int  # this store's first page in the step's accumulator
    times: PhaseTimes


class StagedStores:
    """The step's stores: ``save_layer`` per saved layer, then ``finish`` once."""

    def __init__(self, worker: StorePool, specs: list[StoreSpec], engine: StagingEngine, client) -> None:
        self.worker, self.specs, self.engine, self.client = worker, list(specs), engine, client
        self._plans: list[_StorePlan] | None = None  # None: not reserved yet
        self._acc: torch.Tensor | None = None
        self._enqueued = [False] * len(engine.groups)
        self._error: BaseException | None = None
        self.seconds: float | None = None  # GPU time from the first gather to the last copy, once finished
        Event = torch.cuda.Event
        self._last_gather, self._start, self._end = Event(), Event(enable_timing=True), Event(enable_timing=True)
        self._started = False

    @torch.inference_mode()  # vLLM's KV may be inference tensors; ours are, whoever calls
    def _reserve(self) -> None:
        """Reserve pages for every spec (the pool grants chunks it does not hold) and plan their copies."""
        self._plans = []
        engine, C = self.engine, self.worker.kv_layout.chunk_tokens
        base = 0
        for spec in self.specs:
            times = PhaseTimes()
            reservation = self.worker.reserve(self.client, spec, times)
            if reservation is None:
                continue
            try:
                offsets = [offset for _, offset in reservation.grants]
                chunks = [spec.first_chunk + index for index, _ in reservation.grants]
                if (chunks[-1] + 1) * C > len(spec.block_ids) * engine.paged.block_size:
                    raise ValueError(f"chunk {chunks[-1]} of {spec.req_id} reaches past its {len(spec.block_ids)} blocks")
                engine.ensure_registered(self.client)
                slots = engine.slots(spec.block_ids, chunks, engine.store_reshape)
                self._plans.append(_StorePlan(spec, reservation, engine.units(offsets, self.client), slots, base, times))
                base += len(offsets)
            except Exception as exc:  # a bug: give the pages back, vLLM keeps serving
                log.error("kvshare: planning the store of %s failed", spec.req_id, exc_info=True)
                self.worker.abort(self.client, reservation.reservation_id, exc)
        if self._plans:
            with torch.cuda.stream(engine.store_reshape):
                self._acc = torch.zeros(base, dtype=torch.int64, device=engine.device)

    def save_layer(self, index: int) -> None:
        """vLLM's kernels that write layer ``index`` are enqueued: copy its group out once the group is complete."""
        if self._plans is None:
            self._reserve()
        group = self.engine.group_of_layer[index]
        if self._plans and index == self.engine.groups[group][1] - 1 and not self._enqueued[group]:
            self._enqueue([group])

    @torch.inference_mode()
    def _enqueue(self, groups: list[int]) -> None:
        engine = self.engine
        reshape, copy, buffers = engine.store_reshape, engine.store_copy, engine.store_buffers
        if self._error is not None:
            return
        try:
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(engine.device))  # after every kernel vLLM enqueued so far
            engine.order_after_producer(reshape, produced)
            if not self._started:
                self._start.record(reshape)
                self._started = True
            for group in groups:
                self._enqueued[group] = True
                for plan in self._plans:
                    for unit in plan.units[group]:
                        index = buffers.take()
                        buffer = buffers.tensors[index]
                        reshape.wait_event(buffers.idle[index])  # the previous copy out of this buffer is done
                        with torch.cuda.stream(reshape):
                            self._gather(plan, unit, buffer)
                        gathered = torch.cuda.Event()
                        gathered.record(reshape)
                        copy.wait_event(gathered)
                        engine.host_copies(unit, buffer, copy, self.client, to_device=False)
                        buffers.idle[index].record(copy)
        except Exception as exc:  # reported by finish(): every page of the step is aborted
            log.error("kvshare: enqueueing the step's stores failed", exc_info=True)
            self._error = exc
        finally:
            self._last_gather.record(reshape)

    def _gather(self, plan: _StorePlan, unit: Unit, buffer: torch.Tensor) -> None:
        engine = self.engine
        staged = engine.staged(buffer, unit)  # [n, g, 2, C, H, D]
        whole = Segment(unit.page_start, unit.page_stop, 0, self.worker.kv_layout.chunk_tokens)
        for j in range(unit.num_layers):
            gather_staged(engine.blocks[unit.layer_start + j], staged[:, j], plan.slots, whole, unit.page_start)
        acc = self._acc[plan.base + unit.page_start : plan.base + unit.page_stop]
        add_rows(acc, engine.rows(buffer, unit), engine.word_offset(unit))

    def finish(self, may_commit: Callable[[StoreSpec], bool]) -> int:
        """Copy what was not saved yet, wait for every copy, commit (or abort); returns the pages committed."""
        if self._plans is None:
            self._reserve()
        if not self._plans:
            return 0
        engine = self.engine
        missing = [g for g, done in enumerate(self._enqueued) if not done]
        if missing:
            self._enqueue(missing)
        torch.cuda.current_stream(engine.device).wait_event(self._last_gather)  # vLLM reuses the blocks after our reads
        engine.store_copy.wait_event(self._last_gather)
        self._end.record(engine.store_copy)
        self._end.synchronize()
        sums: list[int] = []
        if self._error is None:
            self.seconds = self._start.elapsed_time(self._end) / 1e3
            with torch.cuda.stream(engine.store_reshape):  # read back on our idle stream, not behind vLLM's
                sums = as_unsigned(self._acc)
        committed = 0
        for plan in self._plans:
            if self._error is not None or not may_commit(plan.spec):
                self.worker.abort(self.client, plan.reservation.reservation_id, self._error)
                continue
            # a store's time: its share of the GPU copies and its commit (not the forward it spans)
            plan.times = PhaseTimes()
            plan.times.add("gpu_copy", self.seconds * len(plan.reservation.grants) / max(len(sums), 1))
            checksums = sums[plan.base : plan.base + len(plan.reservation.grants)]
            committed += self.worker.commit(self.client, plan.spec, plan.reservation, checksums,
                                            ChecksumKind.WSUM32, plan.times)
        self._plans, self._acc = [], None
        return committed
