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

A tensor parallel rank's stores (``spec.is_parted``) are reserved by the scheduler side already: the
rank writes its heads into the granted pages (staging.store_copies) and reports a ``StorePart``, its
part of each page's WSUM32 summed on the GPU, or that it could not write; the scheduler commits once
every rank's part is in (kvshare.integrations.vllm.tensor_parallel). A rank holding a replicated head
that another rank writes copies nothing and reports 0, as on CPU (hooks.store_part).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from kvshare.integrations.vllm.metadata import PhaseTimes, StorePart, StoreSpec
from kvshare.integrations.vllm.staging import Segment, StagingEngine, gather_staged
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.wsum import as_unsigned
from kvshare.transfer.plan import Unit

log = logging.getLogger("kvshare.integrations")

FAILED_LOAD = "computed from a load that failed"  # why a rank does not write its part (as hooks.store_part)


class StorePool(Protocol):
    """What the stores need to reserve, commit and abort pages (pool_pages.PoolPages is one)."""

    kv_layout: KVLayout

    def reserve(self, client, spec: StoreSpec, times: PhaseTimes): ...

    def client_for(self, pool_id: bytes): ...

    def commit(self, client, spec: StoreSpec, reservation, checksums: list[int], kind: ChecksumKind,
               times: PhaseTimes) -> int: ...

    def abort(self, client, reservation_id: int, exc: BaseException | None) -> None: ...


@dataclass
class _StorePlan:
    spec: StoreSpec
    reservation: object  # kvshare.pool.client.ReservationGrant; None: the scheduler's (a tensor parallel part)
    grants: tuple  # (index into the spec's keys, page offset) of each page written
    units: list[list[Unit]]  # per layer group
    slots: tuple  # (block, slot) per token of each granted page, [n, C] each, on the device
    base: int  # this store's first page in the step's accumulator
    times: PhaseTimes


class StagedStores:
    """The step's stores: ``save_layer`` per saved layer, then ``finish`` once."""

    def __init__(self, worker: StorePool, specs: list[StoreSpec], engine: StagingEngine, client) -> None:
        self.worker, self.specs, self.engine, self.client = worker, list(specs), engine, client
        self._plans: list[_StorePlan] | None = None  # None: not reserved yet
        self._unplanned: list[tuple[StoreSpec, str]] = []  # parted specs this rank copies nothing of, and why
        self.parts: list[StorePart] = []  # this rank's parts of the parted specs, once finished
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
            if spec.is_parted:
                reservation, grants = None, spec.grants
                reason = self._part_client(spec)
                if reason is not None:
                    self._unplanned.append((spec, reason))
                    continue
            else:
                reservation = self.worker.reserve(self.client, spec, times) if self.client is not None else None
                if reservation is None:
                    continue
                grants = tuple(reservation.grants)
            try:
                offsets = [offset for _, offset in grants]
                chunks = [spec.first_chunk + index for index, _ in grants]
                if (chunks[-1] + 1) * C > len(spec.block_ids) * engine.paged.block_size:
                    raise ValueError(f"chunk {chunks[-1]} of {spec.req_id} reaches past its {len(spec.block_ids)} blocks")
                engine.ensure_registered(self.client)
                slots = engine.slots(spec.block_ids, chunks, engine.store_reshape)
                units = engine.units(offsets, self.client)
                self._plans.append(_StorePlan(spec, reservation, grants, units, slots, base, times))
                base += len(offsets)
            except Exception as exc:  # a bug: give the pages back (a part: report it unwritten), vLLM keeps serving
                log.error("kvshare: planning the store of %s failed", spec.req_id, exc_info=True)
                if reservation is None:
                    self._unplanned.append((spec, f"{type(exc).__name__}: {exc}"))
                else:
                    self.worker.abort(self.client, reservation.reservation_id, exc)
        if self._plans:
            with torch.cuda.stream(engine.store_reshape):
                self._acc = torch.zeros(base, dtype=torch.int64, device=engine.device)

    def _part_client(self, spec: StoreSpec) -> str | None:
        """For a parted spec: None when this rank writes its heads with the step's client, else why it
        writes nothing ("" for a replicated head another rank writes: it reports 0)."""
        if not self.engine.heads.is_writer:
            return ""
        client, reason = self.worker.client_for(spec.pool_id)
        if client is None:
            return reason
        if self.client is not None and client is not self.client:
            return "the pool connection changed during the step"
        self.client = client
        return None

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
                        engine.host_copies(engine.store_copies(unit), buffer, copy, self.client, to_device=False)
                        buffers.idle[index].record(copy)
        except Exception as exc:  # reported by finish(): every page of the step is aborted
            log.error("kvshare: enqueueing the step's stores failed", exc_info=True)
            self._error = exc
        finally:
            self._last_gather.record(reshape)

    def _gather(self, plan: _StorePlan, unit: Unit, buffer: torch.Tensor) -> None:
        engine = self.engine
        staged = engine.store_staged(buffer, unit)  # [n, g, 2, C, h, D]: every head, or this rank's packed
        whole = Segment(unit.page_start, unit.page_stop, 0, self.worker.kv_layout.chunk_tokens)
        for j in range(unit.num_layers):
            gather_staged(engine.blocks[unit.layer_start + j], staged[:, j], plan.slots, whole, unit.page_start)
        engine.add_store_sums(self._acc[plan.base + unit.page_start : plan.base + unit.page_stop], buffer, unit)

    def finish(self, may_commit: Callable[[StoreSpec], bool]) -> int:
        """Copy what was not saved yet, wait for every copy, commit (or abort); returns the pages committed.
        The parted specs' parts are in ``parts`` after."""
        if self._plans is None:
            self._reserve()
        rank = self.engine.heads.tp_rank
        for spec, reason in self._unplanned:  # as hooks.store_part on CPU: a failed load first, then why not
            if not may_commit(spec):
                reason = FAILED_LOAD
            written = not reason  # reason "": a replicated head another rank writes, reported as 0
            self.parts.append(StorePart(spec.reservation_id, spec.pool_id, rank, written,
                                        (0,) * len(spec.grants) if written else (), reason))
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
            checksums = sums[plan.base : plan.base + len(plan.grants)]
            if plan.reservation is None:  # the scheduler commits once every rank's part is in
                self.parts.append(self._part(plan.spec, may_commit(plan.spec), checksums))
                continue
            if self._error is not None or not may_commit(plan.spec):
                self.worker.abort(self.client, plan.reservation.reservation_id, self._error)
                continue
            # a store's time: its share of the GPU copies and its commit (not the forward it spans)
            plan.times = PhaseTimes()
            plan.times.add("gpu_copy", self.seconds * len(plan.grants) / max(len(sums), 1))
            committed += self.worker.commit(self.client, plan.spec, plan.reservation, checksums,
                                            ChecksumKind.WSUM32, plan.times)
        self._plans, self._acc = [], None
        return committed

    def _part(self, spec: StoreSpec, may_store: bool, checksums: list[int]) -> StorePart:
        """This rank's part of a parted spec it copied: its heads' part of each page's WSUM32, or why not."""
        rank = self.engine.heads.tp_rank
        if not may_store:
            return StorePart(spec.reservation_id, spec.pool_id, rank, False, reason=FAILED_LOAD)
        if self._error is not None:
            return StorePart(spec.reservation_id, spec.pool_id, rank, False,
                             reason=f"{type(self._error).__name__}: {self._error}")
        return StorePart(spec.reservation_id, spec.pool_id, rank, True, tuple(checksums))
