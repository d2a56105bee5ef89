"""The connector's worker-side hooks, one step at a time, in the order vLLM 0.32's model runner calls them.

No vLLM here: ``connector.KVShareConnector`` forwards vLLM's calls (layer names turned into layer
indices), and the H200 harness (benchmarks/vllm_harness_gpu.py) drives the same object directly::

    start_load(plan)        start_load_kv: before the forward when the step loads (sync loads);
                            after it when it does not (vLLM then starts it late)
    wait_layer(l)           wait_for_layer_load, before attention layer l reads its KV
    save_layer(l, plan)     save_kv_layer, after attention layer l wrote its KV
    wait_for_save(plan)     after the forward: loads settled, then stores committed (or aborted)
    load_errors()           get_block_ids_with_load_errors, the same step: blocks vLLM recomputes
    take_outcomes()         build_connector_worker_meta: how each load went, for the scheduler side
    take_store_parts()      ... and, with tensor parallelism, this rank's part of each reserved store

On CPU, loads run in start_load (or, with ``overlap_load``, beside the forward on a helper thread)
and stores in wait_for_save (a tensor parallel rank writes its heads into the pages the scheduler
reserved and reports its part; kvshare.integrations.vllm.tensor_parallel). On a GPU
(``worker.is_staged``) loads are enqueued in start_load and waited for per layer group on vLLM's
stream, stores copy each layer out as it is saved (a rank's parts: staged_stores); the host waits
only in wait_for_save, for what it must know before the step's output counts.
"""

from __future__ import annotations

import logging

from kvshare.integrations.vllm.metadata import LoadOutcome, LoadSpec, PhaseTimes, StepPlan, StorePart, StoreSpec
from kvshare.integrations.vllm.plan import blocks_of_tokens
from kvshare.integrations.vllm.tensor_parallel import partial_wsum32
from kvshare.integrations.vllm.worker import PoolKVWorker

log = logging.getLogger("kvshare.integrations")


class WorkerHooks:
    """One worker's per-step connector state: its layered loads, its stores, the blocks to recompute."""

    def __init__(self, worker: PoolKVWorker, block_size: int, overlap_load: bool = False) -> None:
        self.worker = worker
        self.block_size = block_size
        self._overlap = overlap_load  # CPU: copy loads beside the forward
        self._layer_waits = True  # GPU: vLLM's forward waits per layer (off once a step showed it does not)
        self._outcomes: list[LoadOutcome] = []
        self._store_parts: list[StorePart] = []
        self._invalid_blocks: set[int] = set()
        self._failed_loads: set[str] = set()
        self._layered = None  # this step's loads copying beside the forward (LayeredLoads | StagedLoads)
        self._saving = None  # this step's GPU stores (StagedStores), from its first saved layer on
        self.step_times = PhaseTimes()

    def start_load(self, plan: StepPlan) -> None:
        self._finish_layered()  # (a step always ends in wait_for_save first; this only guards against a skipped one)
        self.step_times = PhaseTimes()  # this step's load, forward and save (logged at DEBUG)
        worker, layered = self.worker, []
        for spec in plan.loads:
            if not worker.layers:
                outcome = LoadOutcome(spec.req_id, spec.token_start, spec.token_end, spec.token_start, "no KV registered")
            elif self._overlap or worker.is_staged:
                outcome = worker.begin_load(spec)
            else:
                outcome = worker.load(spec)
            if isinstance(outcome, LoadOutcome):
                self._settle_load(spec, outcome)
            else:
                layered.append(outcome)
        if layered:
            self._layered = worker.start_layered(layered, wait_now=worker.is_staged and not self._layer_waits)
        self.step_times.mark("load")

    def wait_layer(self, index: int) -> None:
        if self._layered is not None:
            self._layered.wait_layer(index)

    def save_layer(self, index: int, plan: StepPlan) -> None:
        """On a GPU, copy layer ``index`` of the step's stores out now (on CPU stores wait for wait_for_save)."""
        if not self.worker.is_staged or not plan.stores:
            return
        if self._saving is None:
            self._saving = self.worker.begin_stores(list(plan.stores)) or _NoStores()
        self._saving.save_layer(index)

    def wait_for_save(self, plan: StepPlan) -> None:
        times = self.step_times
        times.mark("forward")
        self._finish_layered()
        times.mark("load_finish")
        if self.worker.is_staged:
            saving, self._saving = self._saving, None
            if saving is None and plan.stores and self.worker.layers:
                saving = self.worker.begin_stores(list(plan.stores))  # no layer was saved: all copied now
            if saving is not None:
                saving.finish(self._may_store)
                self._store_parts.extend(saving.parts)  # a tensor parallel rank's parts of the step's stores
        else:
            for spec in plan.stores:
                if spec.is_parted:
                    self._store_parts.append(self.store_part(spec, self._may_store(spec)))
                elif self._may_store(spec):
                    self.worker.store(spec)
        self._failed_loads.clear()
        times.mark("save")
        if plan.loads or plan.stores:
            log.debug("kvshare timing: step - loads=%d stores=%d tokens=%d %s", len(plan.loads), len(plan.stores),
                      plan.num_tokens, times.line())

    def load_errors(self) -> set[int]:
        self._finish_layered()  # already done by wait_for_save, unless vLLM deferred that past this call
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def take_outcomes(self) -> list[LoadOutcome]:
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def take_store_parts(self) -> list[StorePart]:
        parts, self._store_parts = self._store_parts, []
        return parts

    def store_part(self, spec: StoreSpec, may_store: bool) -> StorePart:
        """This rank's heads of a reserved store written into its pages, with their part of each page's
        WSUM32; or why not (which aborts the reservation: no page is ever visible with a head missing)."""
        worker, rank = self.worker, self.worker.heads.tp_rank
        if not may_store:
            return StorePart(spec.reservation_id, spec.pool_id, rank, False, reason="computed from a load that failed")
        if not worker.heads.is_writer:  # a replicated head another rank writes
            return StorePart(spec.reservation_id, spec.pool_id, rank, True, (0,) * len(spec.grants))
        client, reason = worker.pool.client_for(spec.pool_id)
        if client is None:
            return StorePart(spec.reservation_id, spec.pool_id, rank, False, reason=reason)
        try:
            worker.copy_out(client, spec, spec.grants)
            page_bytes = worker.kv_layout.page_bytes
            sums = tuple(partial_wsum32(client.page(offset, page_bytes), worker.kv_layout, worker.heads)
                         for _, offset in spec.grants)
        except Exception as exc:  # a bug in the copy: the reservation is aborted; vLLM keeps serving
            log.error("kvshare: rank %d's part of the store for request %s failed", rank, spec.req_id, exc_info=True)
            return StorePart(spec.reservation_id, spec.pool_id, rank, False, reason=f"{type(exc).__name__}: {exc}")
        return StorePart(spec.reservation_id, spec.pool_id, rank, True, sums)

    def _may_store(self, spec: StoreSpec) -> bool:
        if spec.req_id in self._failed_loads or not self.worker.layers:
            return False  # this step computed from KV that failed to load: nothing of it may be stored
        # nor if it read blocks another request's failed load was to fill (a prefix hit on them)
        return not self._invalid_blocks.intersection(spec.block_ids)

    def _settle_load(self, spec: LoadSpec, outcome: LoadOutcome) -> None:
        self._outcomes.append(outcome)
        if not outcome.is_complete:
            self._failed_loads.add(spec.req_id)
            self._invalid_blocks.update(
                blocks_of_tokens(outcome.loaded_end, outcome.token_end, self.block_size, list(spec.block_ids))
            )

    def _finish_layered(self) -> None:
        """Wait for the step's layered loads; their failures become load errors, as synchronous ones."""
        layered, self._layered = self._layered, None
        if layered is None:
            return
        outcomes, all_waited = layered.finish()
        if not all_waited:
            if self.worker.is_staged:
                self._layer_waits = False
            else:
                self._overlap = False
            log.warning("kvshare: vLLM's forward did not wait for every layer's load (no wait_for_layer_load "
                        "calls?); this step's loads are recomputed and later loads complete before the forward reads")
        for load, outcome in zip(layered.loads, outcomes):
            self._settle_load(load.spec, outcome)


class _NoStores:
    """A step whose stores could not start (the pool unreachable): saved layers are dropped."""

    parts: tuple = ()  # (begin_stores returns stores whenever a spec is a tensor parallel part)

    def save_layer(self, index: int) -> None:
        pass

    def finish(self, may_commit) -> int:
        return 0
