"""A step's loads on a GPU: enqueued in start_load_kv, waited for per layer group, verified on the GPU.

``StagedLoads(...)`` enqueues every copy of the step before it returns (kvshare.integrations.vllm.staging
draws the streams): layer group 0 of every load, then group 1, ... so early layers land first. The
host never waits: ``wait_layer(l)`` only makes vLLM's current stream wait for l's group event::

    load copy     | H2D g0 | H2D g1 | H2D g2 | ...
    load reshape      | scatter+WSUM32 g0 | scatter+WSUM32 g1 | ...
    vLLM stream          wait g0 |-- layer 0 --| wait g1 |-- layer 1 --| ...    wait_for_save: finish()

Verification: a WSUM32 page (written by a GPU) is summed on the GPU over its staged bytes, group by
group, into one int64 per page, read back once, in ``finish``; an xxh3 page (written by a CPU writer)
is hashed on host threads while the copies run (leased pages do not change). Pages are staged whole
whatever heads the rank holds, so a tensor parallel rank verifies every head and scatters only its
own (``StagingEngine.own_heads``). A bad page then ends
its load as a synchronous load would (``settle``): its blocks and all later ones are reported as load
errors before the step's output counts, and vLLM recomputes them. Wrong KV is never served.

Were a layer never waited for (a forward that does not call the hooks), the forward may have read
blocks before their copy landed: every load of the step then fails (as in the CPU overlap module) and
the hooks go over to ``wait_now``, where vLLM's stream waits for the whole load at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvshare.integrations.vllm.metadata import LoadOutcome
from kvshare.integrations.vllm.overlap import LayeredLoad, LayeredLoadWorker
from kvshare.integrations.vllm.staging import Segment, StagingEngine, scatter_staged, segments_of
from kvshare.pool.checksum import ChecksumKind, checksum_is_valid
from kvshare.pool.wsum import add_rows, as_unsigned
from kvshare.transfer.plan import Unit

log = logging.getLogger("kvshare.integrations")


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


def clip(segment: Segment, first: int, stop: int) -> Segment | None:
    """The part of ``segment`` inside pages ``first .. stop - 1``, or None."""
    a, b = max(segment.first, first), min(segment.stop, stop)
    return Segment(a, b, segment.lo, segment.hi) if a < b else None


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
        """Whether each chosen page is valid, in page order: its sum from the GPU (WSUM32) or its check on the
        host threads (xxh3)."""
        refs = [plan.load.spec.pages[p.page_index] for p in plan.load.pieces]
        verdicts = []
        for i, (chosen, kind) in enumerate(zip(plan.load.chosen, plan.kinds)):
            if chosen:
                verdicts.append(checksum_is_valid(refs[i], gpu_sums[plan.base + i]) if kind == ChecksumKind.WSUM32
                                else plan.host_checks[i].result())
        return verdicts
