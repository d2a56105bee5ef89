"""A step's stores on a GPU: each layer group copied out of vLLM's blocks as soon as vLLM saved its last layer.

vLLM calls ``save_kv_layer(l)`` after attention layer l wrote its KV. Per group of layers, once its last
layer was saved, on the staging pipeline's store lane (kvshare.transfer.pipeline, the one the built-in
engine uses)::

    vLLM stream    |-- layer l --| event (recorded here, after the kernels that wrote the layer)
    store reshape       (waits for it) gather blocks -> staging, WSUM32 of the staged pages
    store copy                 (waits for the gather) D2H staging -> reserved pages

The pages are reserved at the step's first saved layer (one pool round trip while vLLM's kernels run).
``finish`` (wait_for_save) enqueues any group never saved, makes vLLM's stream wait for the last gather
(vLLM may hand the blocks to another request once the step ends), waits for the store's end event and
commits each request's pages with their WSUM32 checksums, or aborts them where the step computed from KV
that failed to load. A page is visible only after its commit, and never holds a partial copy. A tensor
parallel rank's stores (``spec.is_parted``, reserved by the scheduler side) write its heads into the
granted pages and report a ``StorePart`` (its part of each page's WSUM32, or why not); the scheduler
commits once every part is in (tensor_parallel). A rank whose replicated head another rank writes
copies nothing and reports 0, as on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvshare.integrations.vllm.counters import PhaseTimes
from kvshare.integrations.vllm.metadata import StorePart, StoreSpec
from kvshare.integrations.vllm.paged_destination import PagedDestination, PagedKV
from kvshare.integrations.vllm.pool_pages import StorePool
from kvshare.integrations.vllm.worker import FAILED_LOAD, StepStores
from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.wsum import as_unsigned
from kvshare.transfer.pipeline import StagingPipeline, UnitWork
from kvshare.transfer.plan import Unit

log = logging.getLogger("kvshare.integrations")


@dataclass
class _StorePlan:
    spec: StoreSpec
    reservation: object  # kvshare.pool.client.ReservationGrant; None: the scheduler's (a tensor parallel part)
    grants: tuple  # (index into the spec's keys, page offset) of each page written
    units: list[list[Unit]]  # per layer group
    destination: PagedDestination  # the granted pages' tokens in the request's blocks
    base: int  # this store's first page in the step's accumulator
    times: PhaseTimes


class StagedStores(StepStores):
    """The step's stores on a GPU: ``save_layer`` per saved layer, then ``finish`` once."""

    def __init__(
        self, worker: StorePool, specs: list[StoreSpec], pipeline: StagingPipeline, kv: PagedKV, client
    ) -> None:
        self.worker, self.specs, self.pipeline, self.kv, self.client = worker, list(specs), pipeline, kv, client
        self._plans: list[_StorePlan] | None = None  # None: not reserved yet
        self._unplanned: list[tuple[StoreSpec, str]] = []  # parted specs this rank copies nothing of, and why
        self.parts: list[StorePart] = []  # this rank's parts of the parted specs, once finished
        self._acc: torch.Tensor | None = None
        self._groups = pipeline.store_groups
        self._group_of_layer = [g for g, (l0, l1) in enumerate(self._groups) for _ in range(l0, l1)]
        self._enqueued = [False] * len(self._groups)
        self._error: BaseException | None = None
        self.seconds: float | None = None  # GPU time from the first gather to the last copy, once finished
        Event = torch.cuda.Event
        self._last_gather, self._start, self._end = Event(), Event(enable_timing=True), Event(enable_timing=True)
        self._started = False

    @torch.inference_mode()  # vLLM's KV may be inference tensors; ours are, whoever calls
    def _reserve(self) -> None:
        """Reserve pages for every spec (the pool grants chunks it does not hold) and plan their copies."""
        self._plans = []
        pipeline, C = self.pipeline, self.worker.kv_layout.chunk_tokens
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
                chunks, num_blocks = [spec.first_chunk + index for index, _ in grants], len(spec.block_ids)
                if (chunks[-1] + 1) * C > num_blocks * self.kv.paged.block_size:
                    raise ValueError(f"chunk {chunks[-1]} of {spec.req_id} reaches past its {num_blocks} blocks")
                pipeline.ensure_registered(self.client)
                slots = self.kv.slots(spec.block_ids, chunks, pipeline.store_lane.reshape)
                units = list(pipeline.plan_groups(offsets, self.client.hello.extent_bytes, self._groups))
                self._plans.append(
                    _StorePlan(spec, reservation, grants, units, self.kv.destination(slots), base, times)
                )
                base += len(offsets)
            except Exception as exc:  # a bug: give the pages back (a part: report it unwritten), vLLM keeps serving
                log.error("kvshare: planning the store of %s failed", spec.req_id, exc_info=True)
                if reservation is None:
                    self._unplanned.append((spec, f"{type(exc).__name__}: {exc}"))
                else:
                    self.worker.abort(self.client, reservation.reservation_id, exc)
        if self._plans:
            with torch.cuda.stream(pipeline.store_lane.reshape):
                self._acc = torch.zeros(base, dtype=torch.int64, device=pipeline.device)

    def _part_client(self, spec: StoreSpec) -> str | None:
        """A parted spec: None if this rank writes its heads, else why not ("" for a replicated head: it reports 0)."""
        if not self.kv.heads.is_writer:
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
        group = self._group_of_layer[index]
        if self._plans and index == self._groups[group][1] - 1 and not self._enqueued[group]:
            self._enqueue([group])

    @torch.inference_mode()
    def _enqueue(self, groups: list[int]) -> None:
        pipeline = self.pipeline
        if self._error is not None:
            return
        try:
            pipeline.store_after(torch.cuda.current_stream(pipeline.device))  # every kernel vLLM enqueued so far
            if not self._started:
                self._start.record(pipeline.store_lane.reshape)
                self._started = True
            for group in groups:
                self._enqueued[group] = True
                works = []
                for plan in self._plans:
                    for unit in plan.units[group]:
                        first = plan.base + unit.page_start  # the unit's first page in the step's accumulator
                        works.append(UnitWork(unit, plan.destination, self._acc[first : first + unit.num_pages]))
                pipeline.store_steps(self.client, works)
        except Exception as exc:  # reported by finish(): every page of the step is aborted
            log.error("kvshare: enqueueing the step's stores failed", exc_info=True)
            self._error = exc
        finally:
            self._last_gather.record(pipeline.store_lane.reshape)

    def finish(self, may_commit: Callable[[StoreSpec], bool]) -> int:
        """Copy what was not saved yet, wait, commit (or abort); the pages committed (parted specs: ``parts``)."""
        if self._plans is None:
            self._reserve()
        rank = self.kv.heads.tp_rank
        for spec, reason in self._unplanned:  # as on CPU (cpu.CpuKVWorker.store_part): a failed load first
            if not may_commit(spec):
                reason = FAILED_LOAD
            written = not reason  # reason "": a replicated head another rank writes, reported as 0
            self.parts.append(
                StorePart(
                    spec.reservation_id, spec.pool_id, rank, written, (0,) * len(spec.grants) if written else (), reason
                )
            )
        if not self._plans:
            return 0
        lane = self.pipeline.store_lane
        missing = [g for g, done in enumerate(self._enqueued) if not done]
        if missing:
            self._enqueue(missing)
        torch.cuda.current_stream(self.pipeline.device).wait_event(self._last_gather)  # vLLM reuses the blocks
        lane.copy.wait_event(self._last_gather)
        self._end.record(lane.copy)
        self._end.synchronize()
        sums: list[int] = []
        if self._error is None:
            self.seconds = self._start.elapsed_time(self._end) / 1e3
            with torch.cuda.stream(lane.reshape):  # read back on our idle stream, not behind vLLM's
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
            committed += self.worker.commit(
                self.client, plan.spec, plan.reservation, checksums, ChecksumKind.WSUM32, plan.times
            )
        self._plans, self._acc = [], None
        return committed

    def _part(self, spec: StoreSpec, may_store: bool, checksums: list[int]) -> StorePart:
        """This rank's part of a parted spec it copied: its heads' part of each page's WSUM32, or why not."""
        rank = self.kv.heads.tp_rank
        if not may_store:
            return StorePart(spec.reservation_id, spec.pool_id, rank, False, reason=FAILED_LOAD)
        if self._error is not None:
            return StorePart(
                spec.reservation_id, spec.pool_id, rank, False, reason=f"{type(self._error).__name__}: {self._error}"
            )
        return StorePart(spec.reservation_id, spec.pool_id, rank, True, tuple(checksums))
