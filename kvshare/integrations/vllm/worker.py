"""The connector's worker side: its hooks, one step at a time, in the order vLLM 0.32's model runner calls them.

No vLLM here: ``connector.KVShareConnector`` forwards vLLM's calls (layer names turned into layer
indices), and the H200 harness (benchmarks/vllm_harness_gpu.py) drives the same object directly::

    start_load(plan)        start_load_kv: before the forward when the step loads (sync loads);
                            after it when it does not (vLLM then starts it late); a step vLLM may replay
                            as one full CUDA graph (plan.no_layer_hooks) has its loads complete first
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
stream, stores copy each layer out as it is saved (a rank's parts: gpu.StagedStores); the host waits
only in wait_for_save, for what it must know before the step's output counts.

``WorkerHooks`` keeps a step's state; ``PoolKVWorker`` moves KV between the pool and vLLM's paged
KV tensors (given in layer order with their PagedLayout): on CPU through ``cpu.CpuCopies``, on a GPU
("staged") through ``gpu.StagedLoads`` / ``gpu.StagedStores``: ``begin_load`` + ``start_layered``
enqueue a step's loads, ``begin_stores`` returns the step's stores, which copy each layer out as vLLM
saves it; pages a GPU writes carry WSUM32 checksums, verified on the GPU by the next GPU reader.
``begin_load`` on CPU plans a load copied layer by layer beside the forward (overlap), where the
checksums are only known after the forward read the bytes; ``settle`` says where a load's trusted
tokens end either way, and the tokens from a bad page on are reported before the step's output counts.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from kvshare.integrations.vllm.block_copy import CpuBlockCopier, leave_the_callers_cores
from kvshare.integrations.vllm.counters import ConnectorCounters, PhaseTimes
from kvshare.integrations.vllm.cpu import CpuCopies
from kvshare.integrations.vllm.gpu import StagedLoads, StagedStores
from kvshare.integrations.vllm.layout import PagedLayout
from kvshare.integrations.vllm.metadata import LoadOutcome, LoadSpec, StepPlan, StorePart, StoreSpec
from kvshare.integrations.vllm.overlap import LayeredLoad, LayeredLoads
from kvshare.integrations.vllm.page_slices import PageSlice, blocks_of_tokens, copy_runs, load_pieces
from kvshare.integrations.vllm.paged_destination import PagedKV
from kvshare.integrations.vllm.pool_pages import PoolPages
from kvshare.integrations.vllm.tensor_parallel import HeadSlice
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind, PageHasher, PageSampler
from kvshare.pool.link import PoolLink
from kvshare.transfer.base import TransferConfig
from kvshare.transfer.pipeline import StagingPipeline

log = logging.getLogger("kvshare.integrations")

# the GPU path's copies: 2-D copies (cuda-bindings) of rows >= 2 MiB, two 128 MiB staging buffers per direction
GPU_TRANSFER = TransferConfig(staging_bytes=128 << 20)


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
                reason = "no KV registered"
                outcome = LoadOutcome(spec.req_id, spec.token_start, spec.token_end, spec.token_start, reason)
            elif worker.is_staged or (self._overlap and not plan.no_layer_hooks):
                outcome = worker.begin_load(spec)
            else:
                outcome = worker.load(spec)
            if isinstance(outcome, LoadOutcome):
                self._settle_load(spec, outcome)
            else:
                layered.append(outcome)
        if layered:
            wait_now = worker.is_staged and (plan.no_layer_hooks or not self._layer_waits)
            self._layered = worker.start_layered(layered, wait_now=wait_now)
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
                    self._store_parts.append(self.worker.store_part(spec, self._may_store(spec)))
                elif self._may_store(spec):
                    self.worker.store(spec)
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
            log.warning(
                "kvshare: vLLM's forward did not wait for every layer's load (no wait_for_layer_load "
                "calls?); this step's loads are recomputed and later loads complete before the forward reads"
            )
        for load, outcome in zip(layered.loads, outcomes):
            self._settle_load(load.spec, outcome)


class _NoStores:
    """A step whose stores could not start (the pool unreachable): saved layers are dropped."""

    parts: tuple = ()  # (begin_stores returns stores whenever a spec is a tensor parallel part)

    def save_layer(self, index: int) -> None:
        pass

    def finish(self, may_commit) -> int:
        return 0


class PoolKVWorker(CpuCopies):
    """Moves KV between the pool and one vLLM worker's paged KV tensors."""

    def __init__(
        self,
        kv_layout: KVLayout,
        link: PoolLink,
        verify_fraction: float = 1.0,
        copy_threads: int = 1,
        rng: random.Random | None = None,
        transfer: TransferConfig = GPU_TRANSFER,
        staged: bool | None = None,
        pipeline_class: type[StagingPipeline] = StagingPipeline,
        heads: HeadSlice | None = None,
    ) -> None:
        """``staged``: move KV through GPU staging (None: when the KV tensors are on CUDA; True on CPU
        tensors runs the same path under a fake CUDA, for tests). ``pipeline_class``: the validation's
        deliberately unordered control replaces it. ``heads``: the page heads this tensor parallel rank's
        tensors hold (None: all, one rank)."""
        self._sampler = PageSampler(verify_fraction, rng)  # which pages a load checks
        self.kv_layout = kv_layout
        self.link = link
        self.verify_fraction = verify_fraction
        self.copy_threads = copy_threads
        self.counters = ConnectorCounters()
        self.heads = heads or HeadSlice(0, 1, 0, kv_layout.num_kv_heads)
        self.pool = PoolPages(link, kv_layout, self.counters)  # lease checks, drops, reserve / commit / abort
        self.layers: list[torch.Tensor] = []
        self.paged: PagedLayout | None = None
        self._copier: CpuBlockCopier | None = None  # on CPU: whole-block copies
        self._hasher = PageHasher(copy_threads, initializer=leave_the_callers_cores)  # on CPU: checksums
        self._loader: ThreadPoolExecutor | None = None  # on CPU: the thread that copies loads beside the forward
        self.transfer = transfer
        self._staged = staged
        self._pipeline_class = pipeline_class
        self._staging: StagingPipeline | None = None  # on a GPU: streams, staging buffers, the registered arena
        self._paged_kv: PagedKV | None = None  # on a GPU: vLLM's blocks as the pipeline's destination
        self._staged_hasher: PageHasher | None = None  # on a GPU: checks xxh3 pages (CPU writers') beside the copies

    def register(self, layers: list[torch.Tensor], paged: PagedLayout) -> None:
        """vLLM's KV tensors, one per model layer in layer order, all in layout ``paged``."""
        if len(layers) != self.kv_layout.num_layers:
            raise ValueError(f"vLLM registered {len(layers)} KV layers, the model has {self.kv_layout.num_layers}")
        if paged.num_kv_heads != self.heads.num_heads:
            raise ValueError(f"vLLM's KV tensors hold {paged.num_kv_heads} KV heads, this rank holds {self.heads}")
        self.layers = list(layers)
        self.paged = paged
        if self._copier is not None:
            self._copier.close()
        self._close_staging()
        staged = self.device.type == "cuda" if self._staged is None else self._staged
        if not staged and self.device.type != "cpu":
            raise ValueError(
                f"KV tensors on {self.device} move through GPU staging only (staged=False needs CPU tensors)"
            )
        if staged:
            kv = PagedKV(self.layers, paged, self.kv_layout, self.heads)
            self._staging = self._pipeline_class(
                self.kv_layout,
                self.transfer,
                self.device,
                shared_lane=False,
                heads=(self.heads.first_head, self.heads.num_heads),
                warm_up_with=kv.scratch(),
            )
            self._paged_kv, self._staged_hasher = kv, PageHasher(self.transfer.num_checksum_threads)
        self._copier = CpuBlockCopier(self.layers, paged, self.copy_threads, self.heads.heads) if not staged else None

    @property
    def is_staged(self) -> bool:
        """Whether KV moves through GPU staging, layer group by layer group (else: the CPU copies)."""
        return self._staging is not None

    def prepare(self) -> None:
        """Connect now (and pin the arena on CUDA) so the first request does not pay for it."""
        client = self.link.client()
        if client is not None and self._staging is not None:
            try:
                self._staging.ensure_registered(client)
            except Exception:  # the first copy raises it again, where it is reported as a failed copy
                log.error("kvshare: pinning the pool arena for CUDA failed", exc_info=True)

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()
        self._close_staging()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        self._hasher.close()
        self.link.close()

    def _close_staging(self) -> None:
        """Wait for the pipeline's copies, unpin the arena, stop the hashing threads."""
        if self._staging is not None:
            self._staging.close()
            self._staged_hasher.close()
            self._staging = self._paged_kv = self._staged_hasher = None

    @property
    def copier(self) -> CpuBlockCopier | None:
        return self._copier

    def start_layered(self, loads: list[LayeredLoad], wait_now: bool = False) -> LayeredLoads | StagedLoads:
        """Start copying ``loads`` layer by layer: on a GPU enqueued at once (``wait_now``: vLLM's stream waits
        for all of it here, for a forward that does not wait per layer), on CPU on the loader thread."""
        if self._staging is not None:
            return StagedLoads(self, loads, self._staging, self._paged_kv, self._staged_hasher, wait_now)
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvshare-load", initializer=leave_the_callers_cores)
        return LayeredLoads(self, loads, self._loader)

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    # -- loads ---------------------------------------------------------------------

    def begin_load(self, spec: LoadSpec) -> LayeredLoad | LoadOutcome:
        """A load to copy layer by layer beside the forward (on a GPU: gpu.StagedLoads; on CPU whole blocks:
        the overlap module), or, where that cannot be, the outcome of loading it now."""
        if self._copier is None and self._staging is None:
            return self.load(spec)
        times = PhaseTimes()
        client, reason = self.pool.client_for(spec.pool_id) if spec.pages else (None, "no lease backs the load")
        if client is None:
            return self.outcome(spec, spec.token_start, reason, times)
        if self._staging is not None:
            pieces, reason = load_pieces(spec, self.kv_layout)
            if not pieces:
                return self.outcome(spec, spec.token_start, reason, times)
            return LayeredLoad(spec, pieces, [self._sampler.draw() for _ in pieces], reason, times, client=client)
        try:
            if any(spec.pages[i].checksum_kind != ChecksumKind.XXH3 for i in range(len(spec.pages))):
                return self.load(spec)  # the layered CPU copy streams xxh3 only; a GPU-written page loads now
            pieces, reason = load_pieces(spec, self.kv_layout)
            offsets = [spec.pages[p.page_index].offset for p in pieces]
            runs = copy_runs(
                pieces, offsets, self.kv_layout.page_bytes, self.kv_layout.chunk_tokens, client.hello.extent_bytes
            )
            if not pieces or not all(self._copier_takes(pieces[run.first].chunk, run) for run in runs):
                return self.load(spec)  # nothing to copy, or not whole blocks (the token copy): now
            layered = LayeredLoad(spec, pieces, [self._sampler.draw() for _ in pieces], reason, times)
            layered.runs = [
                self._block_run(client, offsets[run.first], run, pieces[run.first].chunk, spec.block_ids)
                for run in runs
            ]
        except Exception as exc:
            log.error("kvshare: load for request %s failed", spec.req_id, exc_info=True)
            return self.outcome(spec, spec.token_start, f"{type(exc).__name__}: {exc}", times)
        times.mark("plan")
        return layered

    def outcome(self, spec: LoadSpec, loaded_end: int, reason: str, times: PhaseTimes) -> LoadOutcome:
        """Count and log a finished load; the outcome the scheduler side is told."""
        bytes_per_token, threads = self.kv_layout.bytes_per_token, torch.get_num_threads()
        return self.counters.count_load(spec, loaded_end, reason, times, bytes_per_token, threads)

    def settle(
        self, spec: LoadSpec, pieces: list[PageSlice], chosen: list[bool], verdicts: Iterator[bool], reason: str
    ) -> tuple[int, str]:
        """Where a load's trusted tokens end: at the first chosen page found not valid (next of ``verdicts``,
        one per chosen page in order, from kvshare.pool.checksum), which is then dropped from the pool."""
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

    # -- stores --------------------------------------------------------------------

    def begin_stores(self, specs: list[StoreSpec]) -> StagedStores | None:
        """A step's stores on a GPU: save_layer per layer, then finish. None when there are none, or the pool
        is unreachable and no spec is a tensor parallel part (a part is reported even then: not written)."""
        client = self.link.client()
        if not specs or (client is None and not any(spec.is_parted for spec in specs)):
            return None
        return StagedStores(self.pool, specs, self._staging, self._paged_kv, client)
