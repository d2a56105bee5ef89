"""A step's loads and stores on a GPU: what start_load_kv, wait_for_layer_load and save_kv_layer enqueue.

Loads: ``StagedLoads(...)`` (start_load_kv) enqueues every copy of the step before it returns, on the
streams staging draws: layer group 0 of every load, then group 1, ... so early layers land first. The
host never waits: ``wait_layer(l)`` only makes vLLM's current stream wait for l's group event::

    load copy     | H2D g0 | H2D g1 | H2D g2 | ...
    load reshape      | scatter+WSUM32 g0 | scatter+WSUM32 g1 | ...
    vLLM stream          wait g0 |-- layer 0 --| wait g1 |-- layer 1 --| ...    wait_for_save: finish()

A WSUM32 page (written by a GPU) is summed on the GPU over its staged bytes, group by group, into one
int64 per page, read back once in ``finish``; an xxh3 page (written by a CPU) is hashed on host threads
while the copies run (leased pages do not change). Pages are staged whole, so a tensor parallel rank
verifies every head and scatters only its own (``StagingEngine.own_heads``). A bad page ends its load
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
from dataclasses import dataclass
from typing import Callable

import torch

from kvshare.integrations.vllm.metadata import LoadOutcome, PhaseTimes, StorePart, StoreSpec
from kvshare.integrations.vllm.overlap import LayeredLoad, LayeredLoadWorker
from kvshare.integrations.vllm.pool_pages import StorePool
from kvshare.integrations.vllm.staging import Segment, StagingEngine, clip, gather_staged, scatter_staged, segments_of
from kvshare.pool.checksum import ChecksumKind, checksum_is_valid
from kvshare.pool.wsum import add_rows, as_unsigned
from kvshare.transfer.plan import Unit

log = logging.getLogger("kvshare.integrations")

FAILED_LOAD = "computed from a load that failed"  # why a rank does not write its part (as CpuCopies.store_part)


@dataclass
class _LoadPlan:
    load: LayeredLoad
    offsets: list[int]
    kinds: list[ChecksumKind]
    units: list[list[Unit]]  # per layer group
    segments: list[Segment]
    slots: tuple  # (block, slot) per token of each page, [n, C] each, on the device
    base: int  # this load's first page in the step's accumulator
    host_checks: dict  # piece index -> future of an xxh3 page's verdict (is_valid, on the hashing threads)
    is_gpu_verified: bool  # some chosen page is WSUM32: sum every unit on the GPU


class StagedLoads:
    """The step's loads, in flight from construction on; ``finish`` says how each went."""

    def __init__(self, worker: LayeredLoadWorker, loads: list[LayeredLoad], engine: StagingEngine,
                 wait_now: bool = False) -> None:
        self.worker, self.loads, self.engine = worker, loads, engine
        self.num_layers = worker.kv_layout.num_layers
        self._wait_now = wait_now
        self._waited: set[int] = set()
        self._error: BaseException | None = None
        self.seconds: float | None = None  # GPU time of the step's loads, once finished
        Event = torch.cuda.Event
        self._group_events = [Event() for _ in engine.groups]
        self._start, self._end = Event(enable_timing=True), Event(enable_timing=True)
        self._plans: list[_LoadPlan | None] = []  # per load; None: it could not be planned
        self._refused: dict[str, str] = {}  # request id -> why its load could not be planned
        self._acc: torch.Tensor | None = None
        try:
            with torch.inference_mode():  # vLLM's KV may be inference tensors; ours are, whoever calls
                self._enqueue()
        except Exception as exc:  # reported by finish(): the loads fail, vLLM recomputes
            log.error("kvshare: enqueueing the step's loads failed", exc_info=True)
            self._error = exc
        finally:
            last = Event()
            last.record(engine.load_copy)
            engine.load_reshape.wait_event(last)
            self._end.record(engine.load_reshape)  # after whatever was enqueued
        if wait_now:  # the forward does not wait per layer: vLLM's stream waits for the whole load here
            torch.cuda.current_stream(engine.device).wait_event(self._end)

    def _plan(self, load: LayeredLoad, base: int) -> _LoadPlan:
        spec, client, C = load.spec, load.client, self.worker.kv_layout.chunk_tokens
        if client is not self.loads[0].client:
            raise RuntimeError("the step's loads come from different pool connections")
        refs = [spec.pages[p.page_index] for p in load.pieces]
        if (load.pieces[-1].chunk * C + load.pieces[-1].hi - 1) // self.engine.paged.block_size >= len(spec.block_ids):
            raise ValueError(f"the load of {spec.req_id} reaches past the request's {len(spec.block_ids)} blocks")
        offsets, kinds = [r.offset for r in refs], [ChecksumKind(r.checksum_kind) for r in refs]
        slots = self.engine.slots(spec.block_ids, [p.chunk for p in load.pieces], self.engine.load_copy)
        host_checks = {i: self.engine.hasher.submit_valid(client.page(r.offset, r.page_bytes), r)
                       for i, (r, kind, chosen) in enumerate(zip(refs, kinds, load.chosen))
                       if chosen and kind == ChecksumKind.XXH3}
        is_gpu_verified = any(c and k == ChecksumKind.WSUM32 for c, k in zip(load.chosen, kinds))
        return _LoadPlan(load, offsets, kinds, self.engine.units(offsets, client),
                         segments_of([(p.lo, p.hi) for p in load.pieces]), slots, base, host_checks, is_gpu_verified)

    def _enqueue(self) -> None:
        engine, cfg = self.engine, self.engine.config
        copy, reshape = engine.load_copy, engine.load_reshape
        client = self.loads[0].client
        engine.ensure_registered(client)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(engine.device))
        reshape.wait_event(ready)  # scatters write blocks only after vLLM's earlier work on them (zeroing, reads)
        self._start.record(copy)
        if cfg.load_delay_cycles:  # validation: a late copy stream, which a reader that does not wait would race
            with torch.cuda.stream(copy):
                torch.cuda._sleep(cfg.load_delay_cycles)
        base = 0
        for load in self.loads:
            try:
                self._plans.append(self._plan(load, base))
            except Exception as exc:  # this load fails (recomputed); the others go on
                log.error("kvshare: planning the load of %s failed", load.spec.req_id, exc_info=True)
                self._plans.append(None)
                self._refused[load.spec.req_id] = f"{type(exc).__name__}: {exc}"
            base += len(load.pieces)
        with torch.cuda.stream(reshape):
            self._acc = torch.zeros(base, dtype=torch.int64, device=engine.device)  # WSUM32 per page, all loads
        buffers = engine.load_buffers
        for group in range(len(engine.groups)):
            for plan in filter(None, self._plans):
                for unit in plan.units[group]:
                    index = buffers.take()
                    buffer = buffers.tensors[index]
                    copy.wait_event(buffers.idle[index])  # the previous scatter out of this buffer is done
                    engine.host_copies(unit.copies, buffer, copy, client, to_device=True)
                    copied = torch.cuda.Event()
                    copied.record(copy)
                    reshape.wait_event(copied)
                    with torch.cuda.stream(reshape):
                        self._scatter(plan, unit, buffer)
                    buffers.idle[index].record(reshape)
            self._group_events[group].record(reshape)

    def _scatter(self, plan: _LoadPlan, unit: Unit, buffer: torch.Tensor) -> None:
        engine = self.engine
        staged = engine.own_heads(engine.staged(buffer, unit))  # [n, g, 2, C, h, D]: this rank's heads of whole pages
        pieces = [s for s in (clip(seg, unit.page_start, unit.page_stop) for seg in plan.segments) if s is not None]
        for j in range(unit.num_layers):
            for segment in pieces:
                scatter_staged(engine.blocks[unit.layer_start + j], staged[:, j], plan.slots, segment, unit.page_start)
        if plan.is_gpu_verified:
            acc = self._acc[plan.base + unit.page_start : plan.base + unit.page_stop]
            add_rows(acc, engine.rows(buffer, unit), engine.word_offset(unit))

    def wait_layer(self, index: int) -> None:
        """vLLM's current stream waits until layer ``index`` of every load is in its blocks (the host does not)."""
        self._waited.add(index)
        if not self._wait_now:
            group = self.engine.group_of_layer[index]
            torch.cuda.current_stream(self.engine.device).wait_event(self._group_events[group])

    def finish(self) -> tuple[list[LoadOutcome], bool]:
        """Wait for the copies and checksums; each load's outcome, and whether every layer was waited for."""
        all_waited = self._wait_now or len(self._waited) == self.num_layers
        self._end.synchronize()
        gpu_sums: list[int] = []
        if self._error is None:
            self.seconds = self._start.elapsed_time(self._end) / 1e3
            if any(p and p.is_gpu_verified for p in self._plans):
                with torch.cuda.stream(self.engine.load_reshape):  # read back on our idle stream, not behind vLLM's
                    gpu_sums = as_unsigned(self._acc)
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
                    verdicts = self._verdicts(self._plans[index], gpu_sums)
                    loaded_end, reason = self.worker.settle(spec, load.pieces, load.chosen, iter(verdicts),
                                                            load.reason)
                except Exception as exc:  # e.g. dropping a bad page hit a pool error: this load fails, not the step
                    loaded_end, reason = spec.token_start, f"{type(exc).__name__} while checking the load: {exc}"
            outcomes.append(self.worker.outcome(spec, loaded_end, reason, load.times))
        self._plans, self._acc = [], None  # the device tensors go (every use of them has completed)
        return outcomes, all_waited

    def _verdicts(self, plan: _LoadPlan, gpu_sums: list[int]) -> list[bool]:
        """Whether each chosen page is valid, in page order: its GPU sum (WSUM32) or its host threads' check (xxh3)."""
        refs = [plan.load.spec.pages[p.page_index] for p in plan.load.pieces]
        verdicts = []
        for i, (chosen, kind) in enumerate(zip(plan.load.chosen, plan.kinds)):
            if chosen:
                verdicts.append(checksum_is_valid(refs[i], gpu_sums[plan.base + i]) if kind == ChecksumKind.WSUM32
                                else plan.host_checks[i].result())
        return verdicts


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
                chunks, num_blocks = [spec.first_chunk + index for index, _ in grants], len(spec.block_ids)
                if (chunks[-1] + 1) * C > num_blocks * engine.paged.block_size:
                    raise ValueError(f"chunk {chunks[-1]} of {spec.req_id} reaches past its {num_blocks} blocks")
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
        """A parted spec: None if this rank writes its heads, else why not ("" for a replicated head: it reports 0)."""
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
        """Copy what was not saved yet, wait, commit (or abort); the pages committed (parted specs: ``parts``)."""
        if self._plans is None:
            self._reserve()
        rank = self.engine.heads.tp_rank
        for spec, reason in self._unplanned:  # as CpuCopies.store_part on CPU: a failed load first, then why not
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
