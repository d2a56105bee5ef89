"""A step's loads and stores on a GPU: what start_load_kv, wait_for_layer_load and save_kv_layer enqueue.

Both go through the one staging pipeline (kvshare.transfer.pipeline: streams, rotating staging buffers,
the arena's registration, 2-D copies, the load and store loops), into and out of vLLM's blocks as
``staging.PagedKV`` lays them out; this module says what a step enqueues and when.

Loads: ``StagedLoads(...)`` (start_load_kv) enqueues every copy of the step before it returns, on the
pipeline's load lane: layer group 0 of every load, then group 1, ... so early layers land first. The
host never waits: ``wait_layer(l)`` only makes vLLM's current stream wait for l's group event::

    load copy     | H2D g0 | H2D g1 | H2D g2 | ...
    load reshape      | scatter+WSUM32 g0 | scatter+WSUM32 g1 | ...
    vLLM stream          wait g0 |-- layer 0 --| wait g1 |-- layer 1 --| ...    wait_for_save: finish()

Each load's chosen pages are checked by kvshare.transfer.verify.PageCheck, as the built-in engine's: a
WSUM32 page (written by a GPU) is summed on the GPU over its staged bytes, group by group, into one int64
per page, read back in ``finish``; an xxh3 page (written by a CPU) is hashed on host threads while the
copies run (leased pages do not change). Pages are staged whole, so a tensor parallel rank
verifies every head and scatters only its own (``PagedKV.own_heads``). A bad page ends its load
as a synchronous load would (``settle``): its blocks and all later ones are reported as load errors
before the step's output counts, and vLLM recomputes them. Were a layer never waited for (a forward
without the hooks), the forward may have read blocks before their copy landed: every load of the step
then fails (as in the CPU overlap module) and the hooks go over to ``wait_now`` (the whole load at once).

Stores: ``StagedStores``; vLLM calls ``save_kv_layer(l)`` after attention layer l wrote its KV. Per
group of layers, once its last layer was saved::

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
copies nothing and reports 0, as on CPU (CpuCopies.store_part).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvshare.integrations.vllm.counters import PhaseTimes
from kvshare.integrations.vllm.metadata import LoadOutcome, StorePart, StoreSpec
from kvshare.integrations.vllm.overlap import LayeredLoad, LayeredLoadWorker
from kvshare.integrations.vllm.paged_destination import PagedDestination, PagedKV, segments_of
from kvshare.integrations.vllm.pool_pages import StorePool
from kvshare.pool.checksum import ChecksumKind, PageHasher
from kvshare.pool.wsum import as_unsigned
from kvshare.transfer.pipeline import StagingPipeline, UnitWork
from kvshare.transfer.plan import Unit
from kvshare.transfer.verify import PageCheck, can_sum_staged

log = logging.getLogger("kvshare.integrations")

FAILED_LOAD = "computed from a load that failed"  # why a rank does not write its part (as CpuCopies.store_part)


@dataclass
class _LoadPlan:
    load: LayeredLoad
    units: list[list[Unit]]  # per layer group
    destination: PagedDestination  # the load's tokens in the request's blocks
    check: PageCheck  # the chosen pages' checksums, computed beside the copies


class StagedLoads:
    """The step's loads, in flight from construction on; ``finish`` says how each went."""

    def __init__(
        self,
        worker: LayeredLoadWorker,
        loads: list[LayeredLoad],
        pipeline: StagingPipeline,
        kv: PagedKV,
        hasher: PageHasher,
        wait_now: bool = False,
    ) -> None:
        self.worker, self.loads, self.pipeline, self.kv, self.hasher = worker, loads, pipeline, kv, hasher
        self.num_layers = worker.kv_layout.num_layers
        self._wait_now = wait_now
        self._waited: set[int] = set()
        self._error: BaseException | None = None
        self.seconds: float | None = None  # GPU time of the step's loads, once finished
        Event = torch.cuda.Event
        self._group_events = [Event() for _ in pipeline.load_groups]
        self._start, self._end = Event(enable_timing=True), Event(enable_timing=True)
        self._plans: list[_LoadPlan | None] = []  # per load; None: it could not be planned
        self._refused: dict[str, str] = {}  # request id -> why its load could not be planned
        client = loads[0].client
        with torch.inference_mode():  # vLLM's KV may be inference tensors; ours are, whoever calls
            for _ in pipeline.load_steps(
                client, self._work(client), self._start, self._end, self._record_group, self._failed
            ):
                pass  # every group now: vLLM's forward is enqueued after start_load_kv returns
        if wait_now:  # the forward does not wait per layer: vLLM's stream waits for the whole load here
            torch.cuda.current_stream(pipeline.device).wait_event(self._end)

    def _record_group(self, group: int, stream) -> None:
        self._group_events[group].record(stream)

    def _failed(self, exc: Exception) -> None:  # reported by finish(): the loads fail, vLLM recomputes
        log.error("kvshare: enqueueing the step's loads failed", exc_info=exc)
        self._error = exc

    def _work(self, client):
        """The step's units per layer group: group 0 of every load, then group 1, ... (planned first)."""
        pipeline = self.pipeline
        pipeline.ensure_registered(client)
        pipeline.load_after(torch.cuda.current_stream(pipeline.device))  # after vLLM's earlier work on the blocks
        for load in self.loads:
            try:
                self._plans.append(self._plan(load))
            except Exception as exc:  # this load fails (recomputed); the others go on
                log.error("kvshare: planning the load of %s failed", load.spec.req_id, exc_info=True)
                self._plans.append(None)
                self._refused[load.spec.req_id] = f"{type(exc).__name__}: {exc}"
        for group in range(len(pipeline.load_groups)):
            yield [
                UnitWork(unit, plan.destination, plan.check.staged_sums(unit.page_start, unit.page_stop))
                for plan in filter(None, self._plans)
                for unit in plan.units[group]
            ]

    def _plan(self, load: LayeredLoad) -> _LoadPlan:
        spec, client, C = load.spec, load.client, self.worker.kv_layout.chunk_tokens
        if client is not self.loads[0].client:
            raise RuntimeError("the step's loads come from different pool connections")
        refs = [spec.pages[p.page_index] for p in load.pieces]
        if (load.pieces[-1].chunk * C + load.pieces[-1].hi - 1) // self.kv.paged.block_size >= len(spec.block_ids):
            raise ValueError(f"the load of {spec.req_id} reaches past the request's {len(spec.block_ids)} blocks")
        pipeline = self.pipeline
        slots = self.kv.slots(spec.block_ids, [p.chunk for p in load.pieces], pipeline.load_lane.copy)
        chosen = [i for i, is_chosen in enumerate(load.chosen) if is_chosen]
        with torch.cuda.stream(pipeline.load_lane.reshape):  # its sums accumulate there, after each copy lands
            check = PageCheck(
                refs, chosen, client, self.hasher, pipeline.device, on_device=can_sum_staged(self.worker.kv_layout)
            )
        units = list(pipeline.plan_groups([r.offset for r in refs], client.hello.extent_bytes))
        destination = self.kv.destination(slots, segments_of([(p.lo, p.hi) for p in load.pieces]))
        return _LoadPlan(load, units, destination, check)

    def wait_layer(self, index: int) -> None:
        """vLLM's current stream waits until layer ``index`` of every load is in its blocks (the host does not)."""
        self._waited.add(index)
        if not self._wait_now:
            group = self.pipeline.group_of_layer[index]
            torch.cuda.current_stream(self.pipeline.device).wait_event(self._group_events[group])

    def finish(self) -> tuple[list[LoadOutcome], bool]:
        """Wait for the copies and checksums; each load's outcome, and whether every layer was waited for."""
        all_waited = self._wait_now or len(self._waited) == self.num_layers
        self._end.synchronize()
        if self._error is None:
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        total_pages = sum(len(load.pieces) for load in self.loads) or 1
        outcomes = []
        for index, load in enumerate(self.loads):
            spec = load.spec
            if self.seconds is not None:  # the step's GPU time, shared out by pages
                load.times.add("gpu_copy", self.seconds * len(load.pieces) / total_pages)
            if self._error is not None:
                name = type(self._error).__name__
                loaded_end, reason = spec.token_start, f"{name} while enqueueing the copies: {self._error}"
            elif spec.req_id in self._refused:
                loaded_end, reason = spec.token_start, self._refused[spec.req_id]
            elif not all_waited:
                missing = sorted(set(range(self.num_layers)) - self._waited)
                loaded_end, reason = spec.token_start, f"the forward never waited for layers {missing}"
            else:
                try:
                    verdicts = self._verdicts(self._plans[index])
                    loaded_end, reason = self.worker.settle(spec, load.pieces, load.chosen, iter(verdicts), load.reason)
                except Exception as exc:  # e.g. dropping a bad page hit a pool error: this load fails, not the step
                    loaded_end, reason = spec.token_start, f"{type(exc).__name__} while checking the load: {exc}"
            outcomes.append(self.worker.outcome(spec, loaded_end, reason, load.times))
        self._plans = []  # the device tensors go (every use of them has completed)
        return outcomes, all_waited

    def _verdicts(self, plan: _LoadPlan) -> list[bool]:
        """Whether each chosen page is valid, in page order (kvshare.transfer.verify, kvshare.pool.checksum)."""
        with torch.cuda.stream(self.pipeline.load_lane.reshape):  # read back on our idle stream, not behind vLLM's
            bad = set(plan.check.bad_pages())
        return [i not in bad for i, is_chosen in enumerate(plan.load.chosen) if is_chosen]


@dataclass
class _StorePlan:
    spec: StoreSpec
    reservation: object  # kvshare.pool.client.ReservationGrant; None: the scheduler's (a tensor parallel part)
    grants: tuple  # (index into the spec's keys, page offset) of each page written
    units: list[list[Unit]]  # per layer group
    destination: PagedDestination  # the granted pages' tokens in the request's blocks
    base: int  # this store's first page in the step's accumulator
    times: PhaseTimes


class StagedStores:
    """The step's stores: ``save_layer`` per saved layer, then ``finish`` once."""

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
        for spec, reason in self._unplanned:  # as CpuCopies.store_part on CPU: a failed load first, then why not
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
