"""The worker side on a GPU: a step's loads enqueued per layer group in start_load_kv, waited for on vLLM's stream.

Loads and stores go through the one staging pipeline (kvshare.transfer.pipeline: streams, rotating staging
buffers, the arena's registration, 2-D copies, the load and store loops), into and out of vLLM's blocks as
``paged_destination.PagedKV`` lays them out; this module says what a step's loads enqueue and when (its
stores: gpu_stores).

``StagedLoads(...)`` (start_load_kv) enqueues every copy of the step before it returns, on the pipeline's
load lane: layer group 0 of every load, then group 1, ... so early layers land first. The host never
waits: ``wait_layer(l)`` only makes vLLM's current stream wait for l's group event::

    load copy     | H2D g0 | H2D g1 | H2D g2 | ...
    load reshape      | scatter+WSUM32 g0 | scatter+WSUM32 g1 | ...
    vLLM stream          wait g0 |-- layer 0 --| wait g1 |-- layer 1 --| ...    wait_for_save: finish()

A hybrid model's GDN checkpoint moves with its load and out of vLLM's blocks after a step (gpu_states): enqueued
before the load's layer groups, after vLLM's work so far; a step's forward waits for it before its first layer, a
load beside the steps ends after it. Its page is always checked, and a bad one fails the whole load.

Each load's chosen pages are checked by kvshare.transfer.verify.PageCheck, as the built-in engine's: a
WSUM32 page (written by a GPU) is summed on the GPU over its staged bytes, group by group, into one int64
per page, read back in ``finish``; an xxh3 page (written by a CPU) is hashed on host threads while the
copies run (leased pages do not change). Pages are staged whole, so a tensor parallel rank
verifies every head and scatters only its own (``PagedKV.own_heads``). A bad page ends its load
as a synchronous load would (``KVWorker.finish_load``): its blocks and all later ones are reported as load
errors before the step's output counts, and vLLM recomputes them. Were a layer never waited for (a forward
without the hooks), the forward may have read blocks before their copy landed: every load of the step
then fails (as in cpu_overlap) and the hooks go over to ``wait_now`` (the whole load at once).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from kvshare.integrations.vllm.counters import PhaseTimes
from kvshare.integrations.vllm.gpu_prefetch import GpuAhead
from kvshare.integrations.vllm.gpu_states import GpuStates, StateCopy
from kvshare.integrations.vllm.gpu_stores import StagedStores
from kvshare.integrations.vllm.layout import PagedLayout
from kvshare.integrations.vllm.metadata import LoadOutcome, LoadSpec, StoreSpec
from kvshare.integrations.vllm.page_slices import load_pieces
from kvshare.integrations.vllm.paged_destination import PagedDestination, PagedKV, segments_of
from kvshare.integrations.vllm.prefetch import PrefetchMatch
from kvshare.integrations.vllm.tensor_parallel import HeadSlice
from kvshare.integrations.vllm.worker import NO_STATE_BLOCKS, KVWorker, NoStores, PlannedLoad, StepLoads, StepStores
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind, PageHasher
from kvshare.pool.link import PoolLink
from kvshare.transfer.base import TransferConfig
from kvshare.transfer.pipeline import StagingPipeline, UnitWork
from kvshare.transfer.plan import Unit, plan_unit
from kvshare.transfer.verify import PageCheck, can_sum_staged

log = logging.getLogger("kvshare.integrations")

# the GPU path's copies: 2-D copies (cuda-bindings) of rows >= 2 MiB, two 128 MiB staging buffers per direction
GPU_TRANSFER = TransferConfig(staging_bytes=128 << 20)
# an asynchronous load's layer groups enqueued and not yet ended, topped up at every poll (one per step): two keep
# the copy engine busy across a step while each step's host time grows by about one group's enqueueing only
ASYNC_GROUPS_AHEAD = 2
MIN_PREFETCH_BYTES = 64 << 20  # a prefetch buffer smaller than this holds too little of a long prompt to pay


@dataclass
class StagedKV:
    """What a GPU worker moves KV with, once vLLM registered its tensors."""

    pipeline: StagingPipeline  # streams, staging buffers, the registered arena
    kv: PagedKV  # vLLM's blocks as the pipeline's destination
    hasher: PageHasher  # checks xxh3 pages (CPU writers') on host threads beside the copies
    states: GpuStates | None = None  # a hybrid model's GDN state tensors and the buffer its checkpoints cross

    def close(self) -> None:
        """Wait for the pipeline's copies, unpin the arena, stop the hashing threads."""
        self.pipeline.close()
        self.hasher.close()


class GpuKVWorker(KVWorker):
    """Moves KV between the pool and one vLLM GPU worker's paged KV tensors, through GPU staging."""

    def __init__(
        self,
        kv_layout: KVLayout,
        link: PoolLink,
        verify_fraction: float = 1.0,
        rng: random.Random | None = None,
        heads: HeadSlice | None = None,
        transfer: TransferConfig = GPU_TRANSFER,
        pipeline_class: type[StagingPipeline] = StagingPipeline,
    ) -> None:
        """``pipeline_class``: the validation's deliberately unordered control replaces it. On CPU tensors the
        same path runs under a fake CUDA (the tests)."""
        super().__init__(kv_layout, link, verify_fraction, rng, heads)
        self.transfer = transfer
        self._pipeline_class = pipeline_class
        self._staged: StagedKV | None = None  # once KV is registered

    def register(self, layers: list[torch.Tensor], paged: PagedLayout) -> None:
        super().register(layers, paged)
        self._close_staged()
        kv = PagedKV(self.layers, paged, self.kv_layout, self.heads)
        pipeline = self._pipeline_class(
            self.kv_layout,
            self.transfer,
            self.device,
            shared_lane=False,
            heads=(self.heads.first_head, self.heads.num_heads),
            warm_up_with=kv.scratch(),
        )
        states = GpuStates(self.states, pipeline) if self.states is not None else None
        self._staged = StagedKV(pipeline, kv, PageHasher(self.transfer.num_checksum_threads), states)

    @property
    def pipeline(self) -> StagingPipeline:
        return self._staged.pipeline

    @property
    def paged_kv(self) -> PagedKV:
        return self._staged.kv

    def prepare(self) -> None:
        """Connect and pin the arena for CUDA now, so the first request does not pay for it."""
        client = self.link.client()
        if client is not None and self._staged is not None:
            try:
                self._staged.pipeline.ensure_registered(client)
            except Exception:  # the first copy raises it again, where it is reported as a failed copy
                log.error("kvshare: pinning the pool arena for CUDA failed", exc_info=True)

    def prefetch_device(self, num_bytes: int) -> GpuAhead | None:
        """The prefetch buffer copies ahead land in, and its stream (on this worker's pipeline): ``num_bytes``, or
        half the device memory vLLM left free where that is less (None: less than MIN_PREFETCH_BYTES of it)."""
        room = torch.cuda.mem_get_info(self.pipeline.device)[0] // 2
        if room < min(num_bytes, MIN_PREFETCH_BYTES):
            return None
        return GpuAhead(self.pipeline, self.kv_layout, min(num_bytes, room))

    def close(self) -> None:
        self._close_staged()
        super().close()

    def _close_staged(self) -> None:
        if self._staged is not None:
            self._staged.close()
            self._staged = None

    def start_loads(self, specs: list[LoadSpec], per_layer: bool) -> StepLoads:
        """The step's loads enqueued on the pipeline's load lane (``per_layer`` False: vLLM's stream waits for
        all of them here, for a forward that does not wait per layer)."""
        return self._start(specs, wait_now=not per_layer, is_async=False)

    def start_async_load(self, spec: LoadSpec) -> StepLoads:
        """One load enqueued on the load lane, ordered after vLLM's work so far; vLLM's stream never waits for it
        (its CUDA-graph decode steps run on), the load's end event is polled."""
        return self._start([spec], wait_now=False, is_async=True)

    def _start(self, specs: list[LoadSpec], wait_now: bool, is_async: bool) -> StepLoads:
        settled: list[LoadOutcome] = []
        planned: list[PlannedLoad] = []
        for spec in specs:
            times = PhaseTimes()
            client, reason = self.pool.client_for(spec.pool_id) if spec.pages else (None, "no lease backs the load")
            if client is not None and spec.state_page is not None and not self.takes_state(spec):
                client, reason = None, NO_STATE_BLOCKS
            pieces, reason = load_pieces(spec, self.kv_layout) if client is not None else ([], reason)
            if not pieces:
                settled.append(self.outcome(spec, spec.token_start, reason, times))
            else:
                planned.append(PlannedLoad(spec, pieces, [self.sampler.draw() for _ in pieces], reason, times, client))
        if not planned:
            return StepLoads(settled)
        return StagedLoads(self, planned, self._staged, settled, wait_now=wait_now, is_async=is_async)

    def start_stores(self, specs: list[StoreSpec]) -> StepStores:
        """A step's stores: save_layer per layer, then finish. Nothing when the pool is unreachable and no spec
        is a tensor parallel part (a part is reported even then: not written)."""
        client = self.link.client()
        if not specs or (client is None and not any(spec.is_parted for spec in specs)):
            return NoStores(specs, "the pool is unreachable", self.heads.tp_rank)
        return StagedStores(self.pool, specs, self._staged.pipeline, self._staged.kv, client)

    def copy_state_out(self, client, blocks: tuple[int, ...], offset: int) -> tuple[int, ChecksumKind]:
        """The GDN state in ``blocks`` through the device buffer into the checkpoint page at ``offset``, after vLLM's
        work so far; its WSUM32, summed on the GPU."""
        return self._staged.states.store(client, blocks, offset), ChecksumKind.WSUM32


@dataclass
class _LoadPlan:
    load: PlannedLoad
    units: list[list[tuple[Unit, torch.Tensor | None]]]  # per layer group: each unit, and its copy ahead or None
    destination: PagedDestination  # the load's tokens in the request's blocks
    check: PageCheck  # the chosen pages' checksums, computed beside the copies
    ready: object = None  # the copies ahead's event (their units are scattered once it completed)
    state: StateCopy | None = None  # a hybrid model's checkpoint, copied into its GDN blocks before the KV


class StagedLoads(StepLoads):
    """The step's loads on a GPU, in flight from construction on; ``finish`` says how each went (``settled``:
    the step's loads that had nothing to copy). ``is_async``: a load beside vLLM's steps, which no layer of
    a forward waits for; done once its end event has completed."""

    def __init__(
        self,
        worker: KVWorker,
        loads: list[PlannedLoad],
        staged: StagedKV,
        settled: list[LoadOutcome],
        wait_now: bool = False,
        is_async: bool = False,
    ) -> None:
        super().__init__(settled)
        self.is_async = is_async
        self.worker, self.loads, self.pipeline = worker, loads, staged.pipeline
        self.kv, self.hasher, self.states = staged.kv, staged.hasher, staged.states
        pipeline = self.pipeline
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
        self._taken: list[PrefetchMatch] = []  # copies ahead the loads read, given back once they ended
        self._client = client = loads[0].client
        self._enqueued = 0  # layer groups enqueued so far
        self._steps = pipeline.load_steps(
            client, self._work(client), self._start, self._end, self._record_group, self._failed
        )
        if is_async:  # the rest at the polls, a few groups ahead of the copies: vLLM's step pays for those only
            self._enqueue_ahead()
        else:  # every group now: vLLM's forward is enqueued after start_load_kv returns
            self._enqueue(len(pipeline.load_groups))
        compute = torch.cuda.current_stream(pipeline.device)
        if wait_now:  # the forward does not wait per layer: vLLM's stream waits for the whole load here
            compute.wait_event(self._end)
        elif not is_async:  # a GDN layer comes first and is never waited for: its state lands before the forward
            for plan in self._plans:
                if plan is not None and plan.state is not None:
                    compute.wait_event(plan.state.written)

    def _enqueue(self, num_groups: int) -> None:
        """Enqueue up to ``num_groups`` more layer groups; once none is left the load's end event is recorded."""
        with torch.inference_mode():  # vLLM's KV may be inference tensors; ours are, whoever calls
            for _ in range(num_groups):
                if self._steps is None:
                    return
                if next(self._steps, None) is None:
                    self._steps = None
                    return
                self._enqueued += 1

    def _enqueue_ahead(self) -> None:
        """An asynchronous load's next groups, so that ASYNC_GROUPS_AHEAD are enqueued and not yet ended: the copy
        engine stays busy between two polls while each of vLLM's steps enqueues a share of the load. Its pages
        are read only from the arena its copies started on: if that registration went (another pool's arena),
        the rest is not enqueued and the load fails (recomputed)."""
        if self._steps is None:
            return
        if self._enqueued and not self.pipeline.is_registered(self._client):
            self._failed(RuntimeError("the pool's arena changed while the load was being enqueued"))
            self._steps.close()  # records the end event after what was enqueued
            self._steps = None
            return
        in_flight = sum(1 for event in self._group_events[: self._enqueued] if not event.query())
        self._enqueue(ASYNC_GROUPS_AHEAD - in_flight)

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
                UnitWork(
                    unit, plan.destination, plan.check.staged_sums(unit.page_start, unit.page_stop), source, plan.ready
                )
                for plan in filter(None, self._plans)
                for unit, source in plan.units[group]
            ]

    def _plan(self, load: PlannedLoad) -> _LoadPlan:
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
        state = self._state(load)
        match = self._ahead(load, refs)
        units = self._units([r.offset for r in refs], client.hello.extent_bytes, match)
        destination = self.kv.destination(slots, segments_of([(p.lo, p.hi) for p in load.pieces]))
        return _LoadPlan(load, units, destination, check, match.prefetch.copy.done if match else None, state)

    def _state(self, load: PlannedLoad) -> StateCopy | None:
        """A hybrid model's checkpoint of the load enqueued into its GDN blocks (None: the load carries none)."""
        spec = load.spec
        if spec.state_page is None:
            return None
        if self.states is None:
            raise ValueError(f"the load of {spec.req_id} carries a GDN checkpoint and no GDN state is registered")
        return self.states.load(load.client, self.hasher, spec.state_page, spec.state_blocks)

    def _ahead(self, load: PlannedLoad, refs: list) -> PrefetchMatch | None:
        """The copy ahead of the load's first pages, where the router's hint brought one (prefetch)."""
        prefetcher = self.worker.prefetcher
        if prefetcher is None:
            return None
        keys = [load.spec.keys[p.page_index] for p in load.pieces]
        match = prefetcher.take(load.spec.pool_id, keys, refs)
        if match is not None:
            self._taken.append(match)
        return match

    def _units(self, offsets: list[int], extent_bytes, match: PrefetchMatch | None) -> list[list]:
        """Per layer group, the load's units and their sources: a group the copy ahead holds reads its pages
        0..m-1 from there (one unit, no H2D) and stages the rest; the others stage every page."""
        pipeline, n = self.pipeline, len(offsets)
        m, copy = (match.num_pages, match.prefetch.copy) if match is not None else (0, None)
        per_group = []
        for g, units in enumerate(pipeline.plan_groups(offsets, extent_bytes)):
            if copy is None or g >= copy.num_groups:
                per_group.append([(unit, None) for unit in units])
                continue
            group = pipeline.load_groups[g]
            ahead = plan_unit(offsets, self.worker.kv_layout, group, (0, m), extent_bytes)
            rest = next(pipeline.plan_groups(offsets, extent_bytes, [group], first_page=m), []) if m < n else []
            per_group.append([(ahead, copy.source(g, match.first, m))] + [(unit, None) for unit in rest])
        return per_group

    def wait_layer(self, index: int) -> None:
        """vLLM's current stream waits until layer ``index`` of every load is in its blocks (the host does not)."""
        self._waited.add(index)
        if not self._wait_now:
            group = self.pipeline.group_of_layer[index]
            torch.cuda.current_stream(self.pipeline.device).wait_event(self._group_events[group])

    def is_done(self) -> bool:
        """Whether the load has ended; an asynchronous load enqueues its next groups first (polled every step)."""
        self._enqueue_ahead()
        return self._steps is None and self._end.query()

    def finish(self) -> tuple[list[LoadOutcome], bool]:
        all_waited = self.is_async or self._wait_now or len(self._waited) == self.num_layers
        self._enqueue(len(self.pipeline.load_groups))  # an asynchronous load finished early: the rest now
        self._end.synchronize()
        if self._error is None:
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        total_pages = sum(len(load.pieces) for load in self.loads) or 1
        outcomes = list(self.settled)
        for index, load in enumerate(self.loads):
            spec = load.spec
            if self.seconds is not None:  # the step's GPU time, shared out by pages
                load.times.add("gpu_copy", self.seconds * len(load.pieces) / total_pages)
            if self._error is not None:
                reason = f"{type(self._error).__name__} while enqueueing the copies: {self._error}"
            elif spec.req_id in self._refused:
                reason = self._refused[spec.req_id]
            elif not all_waited:
                reason = f"the forward never waited for layers {sorted(set(range(self.num_layers)) - self._waited)}"
            else:
                try:
                    verdicts = self._checked(self._plans[index])
                except Exception as exc:  # reading the sums back failed: this load fails, not the step
                    reason = f"{type(exc).__name__} while checking the load: {exc}"
                else:
                    outcomes.append(self.worker.finish_load(load, iter(verdicts)))
                    continue
            outcomes.append(self.worker.outcome(spec, spec.token_start, reason, load.times))
        self._plans = []  # the device tensors go (every use of them has completed)
        for match in self._taken:  # the scatters out of the copies ahead have ended
            self.worker.prefetcher.give_back(match)
        self._taken = []
        return outcomes, all_waited

    def _checked(self, plan: _LoadPlan) -> list[bool]:
        """Whether each chosen page is valid, in page order (kvshare.transfer.verify, kvshare.pool.checksum); a
        hybrid's checkpoint's verdict into ``plan.load.is_state_good``."""
        with torch.cuda.stream(self.pipeline.load_lane.reshape):  # read back on our idle stream, not behind vLLM's
            bad = set(plan.check.bad_pages())
            if plan.state is not None:
                plan.load.is_state_good = plan.state.is_good()
        return [i not in bad for i, is_chosen in enumerate(plan.load.chosen) if is_chosen]
