"""The connector's worker side: its hooks, one step at a time, over a ``KVWorker``, the CPU or the GPU one.

No vLLM here: ``connector.KVShareConnector`` forwards vLLM's calls (layer names turned into layer
indices), and the H200 harness (benchmarks/vllm_harness_gpu.py) drives the same object directly::

    start_load(plan)        start_load_kv: before the forward when the step loads (sync loads);
                            after it when it does not (vLLM then starts it late); a step vLLM may replay
                            as one full CUDA graph (plan.no_layer_hooks) has its loads complete first;
                            asynchronous loads start here and outlive the step
    wait_layer(l)           wait_for_layer_load, before attention layer l reads its KV
    save_layer(l, plan)     save_kv_layer, after attention layer l wrote its KV
    wait_for_save(plan)     after the forward: loads finished, then stores committed (or aborted)
    poll_async()            get_finished, every step (a step without a forward too): the asynchronous loads
                            that ended, checked; their bad blocks go to load_errors in the same pass
    load_errors()           get_block_ids_with_load_errors, the same step: blocks vLLM recomputes (or, with several
                            cache groups, take_failed_requests: requests vLLM computes whole, in get_transfer_results)
    take_outcomes()         build_connector_worker_meta: how each load went, for the scheduler side
    take_store_parts()      ... and, with tensor parallelism, this rank's part of each reserved store

``KVWorker`` is what both implementations give, and the hooks know no other: ``start_loads`` returns the
step's loads in flight (``StepLoads``: ``wait_layer``, ``finish``), ``start_async_load`` one load that runs
beside vLLM's steps (a ``StepLoads`` polled with ``is_done``: on a GPU on the pipeline's own streams, which
vLLM's stream never waits for; on CPU on the loader thread), ``start_stores`` its stores
(``StepStores``: ``save_layer``, ``finish``). ``cpu.CpuKVWorker`` copies loads before the forward (or, with
``overlap_load``, beside it: cpu_overlap) and stores after it; ``gpu.GpuKVWorker`` enqueues loads per layer
group on its own streams, vLLM's stream waiting per layer, and copies each layer of the stores out as vLLM
saves it (gpu_stores); the host waits only in wait_for_save, for what it must know before the step's output
counts. The connector picks one implementation at start, by vLLM's device.

Both check a load's pages the same way: ``finish_load`` says where its trusted tokens end (at the first
chosen page whose checksum fails, which is then dropped from the pool), and the tokens from a bad page on
are reported before the step's output counts, so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvshare.integrations.vllm.counters import ConnectorCounters, PhaseTimes
from kvshare.integrations.vllm.layout import PagedLayout
from kvshare.integrations.vllm.metadata import LoadOutcome, LoadSpec, StateStoreSpec, StepPlan, StorePart, StoreSpec
from kvshare.integrations.vllm.page_slices import PageSlice, blocks_of_tokens
from kvshare.integrations.vllm.pool_pages import PoolPages
from kvshare.integrations.vllm.state_blocks import StateBlocks
from kvshare.integrations.vllm.tensor_parallel import HeadSlice
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind, PageSampler
from kvshare.pool.link import PoolLink, guarded

if TYPE_CHECKING:
    from kvshare.integrations.vllm.prefetch import Prefetcher

log = logging.getLogger("kvshare.integrations")

FAILED_LOAD = "computed from a load that failed"  # why a rank writes no part of a store
NO_KV = "no KV registered"
NO_STATE_BLOCKS = "no GDN state blocks to load the checkpoint into"


class WorkerHooks:
    """One worker's per-step connector state: the step's loads and stores in flight, the blocks to recompute."""

    def __init__(self, worker: KVWorker, block_size: int, fails_by_request: bool = False) -> None:
        """``fails_by_request``: a failed load is reported by its request (``take_failed_requests``), never by its
        blocks, whose ids vLLM cannot map back to requests where it keeps several cache groups (a hybrid model);
        vLLM then computes that request's whole prompt."""
        self.worker = worker
        self.block_size = block_size
        self.fails_by_request = fails_by_request
        self._failed_requests: set[str] = set()
        self._layer_waits = True  # vLLM's forward waits per layer (off once a step showed it does not)
        self._outcomes: list[LoadOutcome] = []
        self._store_parts: list[StorePart] = []
        self._invalid_blocks: set[int] = set()
        self._failed_loads: set[str] = set()
        self._load_specs: dict[str, LoadSpec] = {}  # this step's loads by request
        self._loads: StepLoads | None = None  # this step's loads, from start_load until they are finished
        # asynchronous loads in flight, each from the step that started it until a get_finished reports it
        self._async: list[StepLoads] = []
        self._async_specs: dict[str, LoadSpec] = {}
        self._stores: StepStores | None = None  # this step's stores, from its first saved layer on
        self.step_times = PhaseTimes()

    def start_load(self, plan: StepPlan) -> None:
        self._finish_loads()  # (a step always ends in wait_for_save first; this only guards against a skipped one)
        self.step_times = PhaseTimes()  # this step's load, forward and save (logged at DEBUG)
        for spec in plan.loads:
            if spec.is_async:
                self.worker.counters.async_loads += 1
                self._async_specs[spec.req_id] = spec
                self._async.append(self.worker.start_async_load(spec) if self.worker.layers else _no_kv([spec]))
        loads = [spec for spec in plan.loads if not spec.is_async]
        if loads:
            self._load_specs = {spec.req_id: spec for spec in loads}
            per_layer = self._layer_waits and not plan.no_layer_hooks
            self._loads = self.worker.start_loads(loads, per_layer) if self.worker.layers else _no_kv(loads)
        self.step_times.mark("load")

    def wait_layer(self, index: int) -> None:
        if self._loads is not None:
            self._loads.wait_layer(index)

    def save_layer(self, index: int, plan: StepPlan) -> None:
        """Layer ``index`` of the step's stores is written: a GPU copies it out now (CPU: in wait_for_save)."""
        if not plan.stores or not self.worker.layers:
            return
        if self._stores is None:
            self._stores = self.worker.start_stores(list(plan.stores))
        self._stores.save_layer(index)

    def wait_for_save(self, plan: StepPlan) -> None:
        times = self.step_times
        times.mark("forward")
        self._finish_loads()
        times.mark("load_finish")
        stores, self._stores = self._stores, None
        if stores is None and plan.stores and not self.worker.layers:
            stores = NoStores(list(plan.stores), NO_KV, self.worker.heads.tp_rank)
        elif stores is None and plan.stores:
            stores = self.worker.start_stores(list(plan.stores))  # no layer was saved: all copied now
        if stores is not None:
            stores.finish(self._may_store)
            self._store_parts.extend(stores.parts)  # a tensor parallel rank's parts of the step's stores
        for state in plan.state_stores:  # after their KV: a checkpoint is looked up only with the chunks before it
            if state.req_id not in self._failed_loads and self.worker.states is not None:
                self.worker.store_state(state)
        self._failed_loads.clear()
        times.mark("save")
        if plan.loads or plan.stores:
            log.debug(
                "kvshare timing: step - loads=%d stores=%d tokens=%d %s",
                len(plan.loads),
                len(plan.stores),
                plan.num_tokens,
                times.line(),
            )

    def poll_async(self) -> set[str]:
        """The requests whose asynchronous loads ended since the last poll, each checked: its outcome is taken
        for the scheduler side and a failed one's blocks are load errors, reported in this same pass."""
        pending, ended = [], []
        for loads in self._async:
            (ended if loads.is_done() else pending).append(loads)
        self._async = pending
        finished: set[str] = set()
        for loads in ended:
            outcomes, _ = loads.finish()
            for outcome in outcomes:
                self._record(outcome, self._async_specs.pop(outcome.req_id))
                finished.add(outcome.req_id)
        return finished

    def load_errors(self) -> set[int]:
        self._finish_loads()  # already done by wait_for_save, unless vLLM deferred that past this call
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def take_failed_requests(self) -> set[str]:
        """The requests whose loads failed since the last call (``fails_by_request``), to report with their end."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    def take_outcomes(self) -> list[LoadOutcome]:
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def take_store_parts(self) -> list[StorePart]:
        parts, self._store_parts = self._store_parts, []
        return parts

    def _may_store(self, spec: StoreSpec) -> bool:
        if spec.req_id in self._failed_loads or not self.worker.layers:
            return False  # this step computed from KV that failed to load: nothing of it may be stored
        # nor if it read blocks another request's failed load was to fill (a prefix hit on them)
        return not self._invalid_blocks.intersection(spec.block_ids)

    def _finish_loads(self) -> None:
        """Wait for the step's loads; a failed one's blocks become load errors, before the step's output counts."""
        loads, self._loads = self._loads, None
        if loads is None:
            return
        outcomes, all_waited = loads.finish()
        if not all_waited:
            self._layer_waits = False
            log.warning(
                "kvshare: vLLM's forward did not wait for every layer's load (no wait_for_layer_load "
                "calls?); this step's loads are recomputed and later loads complete before the forward reads"
            )
        for outcome in outcomes:
            if not outcome.is_complete:
                self._failed_loads.add(outcome.req_id)  # nothing this step computed from it may be stored
            self._record(outcome, self._load_specs[outcome.req_id])

    def _record(self, outcome: LoadOutcome, spec: LoadSpec) -> None:
        """A load's end, for the scheduler side; the blocks of tokens it could not load, for vLLM to recompute."""
        self._outcomes.append(outcome)
        if not outcome.is_complete and self.fails_by_request:
            self._failed_requests.add(outcome.req_id)
        elif not outcome.is_complete:
            self._invalid_blocks.update(
                blocks_of_tokens(outcome.loaded_end, outcome.token_end, self.block_size, list(spec.block_ids))
            )


def _no_kv(specs: list[LoadSpec]) -> StepLoads:
    """Loads that cannot run: no KV tensors were registered."""
    return StepLoads([LoadOutcome(s.req_id, s.token_start, s.token_end, s.token_start, NO_KV) for s in specs])


@dataclass
class PlannedLoad:
    """One request's load, planned: its page slices and which of them are verified, before any copy."""

    spec: LoadSpec
    pieces: list[PageSlice]
    chosen: list[bool]  # per piece: is its page's checksum checked
    reason: str  # why the pieces end before the spec does ("" if they do not)
    times: PhaseTimes
    client: Any  # the pool connection (kvshare.pool.client.PoolClient) whose arena holds the pages
    ahead: Any = None  # a prefetch.PrefetchMatch: the load's first pages come from a copy ahead (CPU)
    is_state_good: bool = True  # a hybrid model's load: its checkpoint page passed its check (else nothing copied)


class StepLoads:
    """A step's loads from ``start_loads`` on; these ended at once (``settled``: copied before it returned, or
    nothing to copy). The layered implementations (cpu_overlap, gpu) copy the rest beside the forward."""

    def __init__(self, settled: list[LoadOutcome]) -> None:
        self.settled = settled

    def wait_layer(self, index: int) -> None:
        """Return once layer ``index`` of every load may be read (on a GPU: once vLLM's stream waits for it)."""

    def is_done(self) -> bool:
        """Whether ``finish`` would return without waiting (an asynchronous load's copies have ended)."""
        return True

    def finish(self) -> tuple[list[LoadOutcome], bool]:
        """Wait for the copies and checksums: each load's outcome, and whether every layer was waited for
        (False: the forward may have read blocks before their copy, so every layered load failed)."""
        return list(self.settled), True


class StepStores:
    """A step's stores from ``start_stores`` on: ``save_layer`` per layer vLLM saved, then ``finish`` once."""

    parts: list[StorePart]  # a tensor parallel rank's parts of the step's reserved stores, once finished

    def save_layer(self, index: int) -> None:
        """vLLM's kernels that write layer ``index`` are enqueued (a GPU copies the layer out from here on)."""

    def finish(self, may_commit: Callable[[StoreSpec], bool]) -> int:
        """Copy what was not copied yet, commit what ``may_commit`` allows (abort the rest); pages committed."""
        raise NotImplementedError


class NoStores(StepStores):
    """A step whose stores cannot start (no KV registered, the pool unreachable): nothing is written, and a
    tensor parallel rank reports each of its parts unwritten, which aborts the reservation."""

    def __init__(self, specs: list[StoreSpec], reason: str, tp_rank: int) -> None:
        self.specs, self.reason, self.tp_rank = specs, reason, tp_rank
        self.parts = []

    def finish(self, may_commit: Callable[[StoreSpec], bool]) -> int:
        for spec in self.specs:
            if spec.is_parted:
                reason = self.reason if may_commit(spec) else FAILED_LOAD
                self.parts.append(StorePart(spec.reservation_id, spec.pool_id, self.tp_rank, False, reason=reason))
        return 0


class KVWorker:
    """Moves KV between the pool and one vLLM worker's paged KV tensors (cpu.CpuKVWorker, gpu.GpuKVWorker).

    ``heads``: the page heads this tensor parallel rank's tensors hold (None: all, one rank)."""

    def __init__(
        self,
        kv_layout: KVLayout,
        link: PoolLink,
        verify_fraction: float = 1.0,
        rng: random.Random | None = None,
        heads: HeadSlice | None = None,
    ) -> None:
        self.kv_layout = kv_layout
        self.link = link
        self.verify_fraction = verify_fraction
        self.sampler = PageSampler(verify_fraction, rng)  # which pages a load checks
        self.counters = ConnectorCounters()
        self.heads = heads or HeadSlice(0, 1, 0, kv_layout.num_kv_heads)
        self.pool = PoolPages(link, kv_layout, self.counters)  # lease checks, drops, reserve / commit / abort
        self.layers: list[torch.Tensor] = []  # vLLM's KV tensors, once registered
        self.paged: PagedLayout | None = None  # their layout, once registered
        self.prefetcher: Prefetcher | None = None  # copies ahead on the router's hints, where configured
        self.states: StateBlocks | None = None  # a hybrid model's GDN state tensors, once registered

    # -- what each implementation gives --------------------------------------------------

    def register(self, layers: list[torch.Tensor], paged: PagedLayout) -> None:
        """vLLM's KV tensors, one per model layer in layer order, all in layout ``paged``."""
        if len(layers) != self.kv_layout.num_layers:
            raise ValueError(f"vLLM registered {len(layers)} KV layers, the model has {self.kv_layout.num_layers}")
        if paged.num_kv_heads != self.heads.num_heads:
            raise ValueError(f"vLLM's KV tensors hold {paged.num_kv_heads} KV heads, this rank holds {self.heads}")
        self.layers, self.paged = list(layers), paged

    def start_loads(self, specs: list[LoadSpec], per_layer: bool) -> StepLoads:
        """Start the step's loads. ``per_layer``: vLLM's forward calls ``wait_layer`` before each attention layer
        reads its KV, so copies may run beside it (else every load is in the blocks before the forward reads)."""
        raise NotImplementedError

    def start_async_load(self, spec: LoadSpec) -> StepLoads:
        """Start one load beside vLLM's steps: nothing of vLLM's waits for it, its blocks belong to a request vLLM
        does not schedule until ``finish`` has reported it (polled with ``is_done``)."""
        raise NotImplementedError

    def start_stores(self, specs: list[StoreSpec]) -> StepStores:
        """The step's stores: copied out of vLLM's blocks into reserved pages, committed in ``finish``."""
        raise NotImplementedError

    def copy_state_out(self, client, blocks: tuple[int, ...], offset: int) -> tuple[int, ChecksumKind]:
        """A hybrid model's GDN state in ``blocks`` (one per GDN layer) copied into the reserved checkpoint page at
        ``offset`` (after the step that wrote it); the page's checksum and its kind, once the copy has ended."""
        raise NotImplementedError

    def prefetch_device(self, num_bytes: int):
        """The room copies ahead land in, ``num_bytes`` of it (prefetch.DeviceAhead: gpu_prefetch, cpu_prefetch)."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Connect now so the first request does not pay for it."""
        self.link.client()

    def close(self) -> None:
        self.link.close()

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    # -- a hybrid model's GDN state --------------------------------------------------------------

    def takes_state(self, spec: LoadSpec) -> bool:
        """Whether the load's checkpoint fits this worker's GDN state tensors and names a block for each layer."""
        states = self.states
        return (
            states is not None
            and spec.state_page.page_bytes == states.layout.checkpoint_bytes
            and len(spec.state_blocks) == states.layout.num_layers
        )

    def store_state(self, spec: StateStoreSpec) -> int:
        """Reserve a checkpoint page, copy the GDN state out of the spec's blocks into it (``copy_state_out``),
        commit it with its checksum; 1 if committed, else 0 (a failed copy gives the page back)."""
        client, num_bytes = self.link.client(), self.states.layout.checkpoint_bytes
        if client is None:
            return 0
        reserve = lambda: client.reserve(  # noqa: E731
            spec.namespace, [spec.key], num_bytes, spec.num_chunks, account=spec.account, holds_states=True
        )
        reservation = guarded(self.link, self.counters, "a checkpoint reserve", reserve)
        if reservation is None or not reservation.grants:
            return 0
        try:
            checksum, kind = self.copy_state_out(client, spec.blocks, reservation.grants[0][1])
        except Exception as exc:  # a bug in the copy: give the page back; vLLM keeps serving
            log.error("kvshare: checkpoint store for request %s failed", spec.req_id, exc_info=True)
            self.pool.abort(client, reservation.reservation_id, exc)
            return 0
        commit = lambda: client.commit(reservation.reservation_id, [checksum], kind)  # noqa: E731
        committed = guarded(self.link, self.counters, "a checkpoint commit", commit) or 0
        self.counters.stored_states += committed
        log.debug("kvshare: checkpoint after %d chunks of %s stored: %d", spec.num_chunks, spec.req_id, committed)
        return committed

    # -- one load or store, complete when it returns -----------------------------------------

    def load(self, spec: LoadSpec) -> LoadOutcome:
        """Copy the spec's tokens into vLLM's blocks before returning; stops at the first page not to be trusted."""
        outcomes, _ = self.start_loads([spec], per_layer=False).finish()
        return outcomes[0]

    def store(self, spec: StoreSpec) -> int:
        """Reserve, fill and commit pages for the spec's chunks (every layer is written); pages committed."""
        stores = self.start_stores([spec])
        for index in range(self.kv_layout.num_layers):
            stores.save_layer(index)
        return stores.finish(lambda _: True)

    # -- a load's end, the same for both -------------------------------------------------------

    def trusted_end(
        self, spec: LoadSpec, pieces: list[PageSlice], chosen: list[bool], verdicts: Iterator[bool], reason: str
    ) -> tuple[int, str]:
        """Where a load's trusted tokens end: at the first chosen page found not valid (next of ``verdicts``,
        one per chosen page in order, from kvshare.pool.checksum), which is then dropped from the pool. A hybrid
        model's load is whole or nothing: its GDN state is of use only with every KV token before it."""
        loaded_end, reason = self._trusted_kv_end(spec, pieces, chosen, verdicts, reason)
        if spec.state_page is not None and loaded_end != spec.token_end:
            return spec.token_start, reason or "the load ends before its GDN checkpoint"
        return loaded_end, reason

    def _trusted_kv_end(
        self, spec: LoadSpec, pieces: list[PageSlice], chosen: list[bool], verdicts: Iterator[bool], reason: str
    ) -> tuple[int, str]:
        trusted = 0
        for piece, is_chosen in zip(pieces, chosen):
            ref = spec.pages[piece.page_index]
            if is_chosen:
                self.counters.verified_pages += 1
                if not next(verdicts):
                    self.counters.checksum_failures += 1
                    self.pool.drop(spec.keys[piece.page_index])
                    reason = f"checksum mismatch in chunk {piece.chunk} (page at offset {ref.offset})"
                    break
            trusted += 1
        if not trusted:
            return spec.token_start, reason
        last = pieces[trusted - 1]
        loaded_end = last.chunk * self.kv_layout.chunk_tokens + last.hi
        if loaded_end != spec.token_end and not reason:
            reason = "the lease does not cover the whole load"
        return loaded_end, reason

    def finish_load(self, load: PlannedLoad, verdicts: Iterator[bool]) -> LoadOutcome:
        """A load copied beside the forward, its chosen pages' ``verdicts`` known: its outcome, counted."""
        try:
            if not load.is_state_good:
                return self.outcome(load.spec, load.spec.token_start, self.drop_state(load.spec), load.times)
            loaded_end, reason = self.trusted_end(load.spec, load.pieces, load.chosen, verdicts, load.reason)
        except Exception as exc:  # e.g. dropping a bad page hit a pool error: this load fails, not the step
            loaded_end, reason = load.spec.token_start, f"{type(exc).__name__} while checking the load: {exc}"
        return self.outcome(load.spec, loaded_end, reason, load.times)

    def drop_state(self, spec: LoadSpec) -> str:
        """A load's checkpoint page failed its check: counted and dropped from the pool; why the load failed."""
        self.counters.checksum_failures += 1
        self.pool.drop(spec.state_key)
        where = f"token {spec.token_end} (page at offset {spec.state_page.offset})"
        return f"checksum mismatch in the GDN checkpoint at {where}"

    def outcome(self, spec: LoadSpec, loaded_end: int, reason: str, times: PhaseTimes) -> LoadOutcome:
        """Count and log a finished load; the outcome the scheduler side is told."""
        bytes_per_token, threads = self.kv_layout.bytes_per_token, torch.get_num_threads()
        return self.counters.count_load(spec, loaded_end, reason, times, bytes_per_token, threads)
