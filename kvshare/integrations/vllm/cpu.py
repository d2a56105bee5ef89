"""The worker side on CPU: loads verified then copied before the forward (or beside it), stores after it.

A load before the forward is synchronous: the pages chosen for verification (every page with
``verify_fraction`` 1, else a share of them that kvshare.pool.checksum's PageSampler draws) are checked
there, before any of their bytes are used; the first page that fails (checksum, a lease from another pool,
a pool gone) ends the load there, and the tokens from that point are reported so that vLLM recomputes them.
With ``overlap_load`` a load of whole blocks of XXH3 pages is copied layer by layer beside the forward
instead (cpu_overlap), its checksums streamed as it lands. Stores run after the forward: reserve pages for
the chunks, copy each chunk out of vLLM's blocks, checksum, commit. A page is visible to other replicas
only after its commit, and never holds a partial copy. Runs of whole blocks move as numpy block copies
over ``copy_threads`` threads (block_copy); anything else as a torch token scatter/gather. A tensor
parallel rank (``heads``) copies only its heads of each page (``store_part``: its part of a reserved
store, tensor_parallel).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvshare.integrations.vllm.block_copy import BlockRun, CpuBlockCopier, leave_the_callers_cores
from kvshare.integrations.vllm.counters import PhaseTimes
from kvshare.integrations.vllm.cpu_overlap import BlockLoad, LayeredLoads
from kvshare.integrations.vllm.cpu_prefetch import CpuAhead
from kvshare.integrations.vllm.layout import PagedLayout, gather_tokens, scatter_tokens, slots_of_positions
from kvshare.integrations.vllm.metadata import LoadOutcome, LoadSpec, StorePart, StoreSpec
from kvshare.integrations.vllm.page_slices import CopyRun, PageSlice, copy_runs, load_pieces
from kvshare.integrations.vllm.tensor_parallel import HeadSlice, partial_wsum32
from kvshare.integrations.vllm.worker import (
    FAILED_LOAD,
    NO_STATE_BLOCKS,
    KVWorker,
    PlannedLoad,
    StepLoads,
    StepStores,
)
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind, PageHasher
from kvshare.pool.link import PoolLink

log = logging.getLogger("kvshare.integrations")


class CpuKVWorker(KVWorker):
    """Moves KV between the pool and one vLLM CPU worker's paged KV tensors."""

    def __init__(
        self,
        kv_layout: KVLayout,
        link: PoolLink,
        verify_fraction: float = 1.0,
        copy_threads: int = 1,
        rng: random.Random | None = None,
        heads: HeadSlice | None = None,
        overlap_load: bool = False,
    ) -> None:
        """``copy_threads``: threads of the block copies and checksums; ``overlap_load``: copy loads of whole
        blocks beside the forward, layer by layer, when vLLM's forward waits per layer."""
        super().__init__(kv_layout, link, verify_fraction, rng, heads)
        self.copy_threads = copy_threads
        self.overlap_load = overlap_load
        self.hasher = PageHasher(copy_threads, initializer=leave_the_callers_cores)  # checksums
        self._copier: CpuBlockCopier | None = None  # whole-block copies, once KV is registered
        self._loader: ThreadPoolExecutor | None = None  # the thread that copies loads beside the forward

    def register(self, layers: list[torch.Tensor], paged: PagedLayout) -> None:
        if layers and layers[0].device.type != "cpu":
            raise ValueError(f"KV tensors on {layers[0].device} move through GPU staging only (gpu.GpuKVWorker)")
        super().register(layers, paged)
        if self._copier is not None:
            self._copier.close()
        self._copier = CpuBlockCopier(self.layers, paged, self.copy_threads, self.heads.heads)

    @property
    def copier(self) -> CpuBlockCopier | None:
        return self._copier

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        self.hasher.close()
        super().close()

    # -- loads ---------------------------------------------------------------------

    def start_loads(self, specs: list[LoadSpec], per_layer: bool) -> StepLoads:
        if not (self.overlap_load and per_layer):
            return StepLoads([self._load_now(spec) for spec in specs])
        settled: list[LoadOutcome] = []
        beside: list[BlockLoad] = []
        for spec in specs:
            self._begin_beside(spec, settled, beside)
        if not beside:
            return StepLoads(settled)
        return LayeredLoads(self, beside, self._copier, self._loader_thread(), settled)

    def _begin_beside(self, spec: LoadSpec, settled: list[LoadOutcome], beside: list[BlockLoad]) -> None:
        """Plan ``spec`` to be copied layer by layer beside the forward (into ``beside``), or, where that cannot
        be (pages not all XXH3, not whole blocks), load it now (its outcome into ``settled``)."""
        times = PhaseTimes()
        client, reason = self.pool.client_for(spec.pool_id) if spec.pages else (None, "no lease backs the load")
        if client is None:
            settled.append(self.outcome(spec, spec.token_start, reason, times))
            return
        try:
            if spec.state_page is not None:  # a hybrid model's load moves its GDN state whole, before any layer
                settled.append(self._load_now(spec))
                return
            if any(spec.pages[i].checksum_kind != ChecksumKind.XXH3 for i in range(len(spec.pages))):
                settled.append(self._load_now(spec))  # the layered copy streams xxh3 only; a GPU-written page: now
                return
            pieces, reason = load_pieces(spec, self.kv_layout)
            offsets = [spec.pages[p.page_index].offset for p in pieces]
            runs = copy_runs(
                pieces, offsets, self.kv_layout.page_bytes, self.kv_layout.chunk_tokens, client.hello.extent_bytes
            )
            if not pieces or not all(self._copier_takes(pieces[run.first].chunk, run) for run in runs):
                settled.append(self._load_now(spec))  # nothing to copy, or not whole blocks (the token copy): now
                return
            load = PlannedLoad(spec, pieces, [self.sampler.draw() for _ in pieces], reason, times, client)
            block_runs = [
                self._block_run(
                    self._raw(client, offsets[run.first], run), run, pieces[run.first].chunk, spec.block_ids
                )
                for run in runs
            ]
        except Exception as exc:
            log.error("kvshare: load for request %s failed", spec.req_id, exc_info=True)
            settled.append(self.outcome(spec, spec.token_start, f"{type(exc).__name__}: {exc}", times))
            return
        times.mark("plan")
        beside.append(BlockLoad(load, block_runs))

    def start_async_load(self, spec: LoadSpec) -> StepLoads:
        load, outcome = self._plan(spec, PhaseTimes())
        if load is None:
            return StepLoads([outcome])
        return BackgroundLoad(self, load, self._loader_thread())

    def _loader_thread(self) -> ThreadPoolExecutor:
        """The one thread that copies loads beside vLLM (layered loads beside a forward, asynchronous ones beside
        whole steps), in the order they were started."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvshare-load", initializer=leave_the_callers_cores)
        return self._loader

    def _plan(self, spec: LoadSpec, times: PhaseTimes) -> tuple[PlannedLoad | None, LoadOutcome | None]:
        """The load's pieces and the pages drawn for verification; or, where there is nothing to copy (no pool,
        no lease, no piece), its outcome."""
        client, reason = self.pool.client_for(spec.pool_id) if spec.pages else (None, "no lease backs the load")
        times.mark("client")
        if spec.state_page is not None and not self.takes_state(spec):
            client, reason = None, NO_STATE_BLOCKS
        pieces, reason = load_pieces(spec, self.kv_layout) if client is not None else ([], reason)
        if not pieces:
            return None, self.outcome(spec, spec.token_start, reason, times)
        # the draws in page order, on the caller's thread (the sampler's generator is not shared between threads)
        load = PlannedLoad(spec, pieces, [self.sampler.draw() for _ in pieces], reason, times, client)
        if self.prefetcher is not None:  # the pages a copy ahead holds come checked: each counts as chosen
            keys, refs = [spec.keys[p.page_index] for p in pieces], [spec.pages[p.page_index] for p in pieces]
            load.ahead = self.prefetcher.take(spec.pool_id, keys, refs)
            for i in range(load.ahead.num_pages if load.ahead is not None else 0):
                load.chosen[i] = True
        return load, None

    def _load_now(self, spec: LoadSpec) -> LoadOutcome:
        """Copy the spec's tokens into vLLM's blocks; stops at the first page that cannot be trusted."""
        load, outcome = self._plan(spec, PhaseTimes())
        if load is None:
            return outcome
        try:
            verdicts = self.verify_and_copy(load)
        except Exception as exc:  # a bug or a vanished mapping: recompute, keep serving
            log.error("kvshare: load for request %s failed", spec.req_id, exc_info=True)
            return self.outcome(spec, spec.token_start, f"{type(exc).__name__}: {exc}", load.times)
        return self.finish_load(load, iter(verdicts))

    def verify_and_copy(self, load: PlannedLoad) -> list[bool]:
        """Check the chosen pages, then copy the pieces before the first one found bad into vLLM's blocks; the
        chosen pages' verdicts, for ``finish_load``. No pool call: it may run on another thread than the hooks'.
        The pieces a copy ahead holds (``load.ahead``) were checked when they were copied (cpu_prefetch)."""
        try:
            spec, client, times = load.spec, load.client, load.times
            ahead = load.ahead
            m = ahead.num_pages if ahead is not None else 0
            verdicts = list(ahead.prefetch.copy.verdicts[ahead.first : ahead.first + m]) if m else []
            # the chosen pages checked all at once, spread over the hashing threads (checksumming each page and
            # copying it right after, while in cache, measured slower: 15-20 ms against 11-13 ms for 8k tokens)
            refs = [spec.pages[p.page_index] for p, c in zip(load.pieces[m:], load.chosen[m:]) if c]
            state = client.page(spec.state_page.offset, spec.state_page.page_bytes) if spec.state_page else None
            if state is not None:  # every checkpoint is checked: a resume stands on it whole
                load.is_state_good = self.hasher.valid([state], [spec.state_page])[0]
                if not load.is_state_good:
                    return verdicts
            verdicts += self.hasher.valid([client.page(ref.offset, self.kv_layout.page_bytes) for ref in refs], refs)
            times.mark("verify")
            left, trusted = iter(verdicts), []
            for piece, is_chosen in zip(load.pieces, load.chosen):
                if is_chosen and not next(left):
                    break
                trusted.append(piece)
            self._copy_trusted(load, trusted[:m], trusted[m:])
            if state is not None and len(trusted) == len(load.pieces):
                self.states.write(state, spec.state_blocks)
            times.mark("copy")
            return verdicts
        finally:
            if load.ahead is not None:  # its copy is read no more
                self.prefetcher.give_back(load.ahead)

    def _copy_trusted(self, load: PlannedLoad, from_ahead: list[PageSlice], from_pool: list[PageSlice]) -> None:
        """Copy a load's trusted pieces into vLLM's blocks: the first ones from its copy ahead, the rest from the
        arena."""
        page_bytes, C, spec = self.kv_layout.page_bytes, self.kv_layout.chunk_tokens, load.spec
        if from_ahead:
            pages, first = load.ahead.prefetch.copy.pages, load.ahead.first  # [n, page_bytes], in page order
            places = [i * page_bytes for i in range(len(from_ahead))]
            for run in copy_runs(from_ahead, places, page_bytes, C):
                raw = pages[first + run.first : first + run.first + run.num_pages].reshape(-1)
                self._copy_run(raw, run, from_ahead[run.first].chunk, spec.block_ids, into_kv=True)
        offsets = [spec.pages[p.page_index].offset for p in from_pool]
        for run in copy_runs(from_pool, offsets, page_bytes, C, load.client.hello.extent_bytes):
            raw = self._raw(load.client, offsets[run.first], run)
            self._copy_run(raw, run, from_pool[run.first].chunk, spec.block_ids, into_kv=True)

    def prefetch_device(self, num_bytes: int) -> CpuAhead:
        """The host buffer copies ahead land in, checked there by this worker's hashing threads."""
        return CpuAhead(self.kv_layout.page_bytes, num_bytes, self.hasher)

    # -- the copies ----------------------------------------------------------------

    def _copier_takes(self, first_chunk: int, run: CopyRun) -> bool:
        """Whether the CPU block copier can move the run: it starts and ends on block boundaries."""
        N = self.paged.block_size
        return (
            self._copier is not None
            and (first_chunk * self.kv_layout.chunk_tokens + run.lo) % N == 0
            and run.hi % N == 0
        )

    def _raw(self, client, offset: int, run: CopyRun) -> np.ndarray:
        """The bytes of the run's pages in the arena (uint8, a view)."""
        return client.run(offset, self.kv_layout.page_bytes, run.num_pages)

    def _block_run(self, raw: np.ndarray, run: CopyRun, first_chunk: int, block_ids) -> BlockRun:
        """The run's pages (``raw``: their bytes) as a [n, L, 2, C, H, D] view and the vLLM blocks of its tokens."""
        N = self.paged.block_size
        pages = raw.view(self._copier.dtype).reshape(run.num_pages, *self.kv_layout.page_shape)
        first_block = (first_chunk * self.kv_layout.chunk_tokens + run.lo) // N
        num_blocks = run.num_pages * (run.hi - run.lo) // N
        return BlockRun(run, pages, block_ids[first_block : first_block + num_blocks])

    def _copy_run(self, raw: np.ndarray, run: CopyRun, first_chunk: int, block_ids, into_kv: bool) -> None:
        """Tokens ``run.lo .. run.hi - 1`` of the run's pages (``raw``: their bytes; chunks ``first_chunk ..``) into
        vLLM's blocks (``into_kv``) or out of them into the pages (whole blocks, or tokens)."""
        C, N = self.kv_layout.chunk_tokens, self.paged.block_size
        if self._copier_takes(first_chunk, run):
            block_run = self._block_run(raw, run, first_chunk, block_ids)
            if into_kv:
                self._copier.to_blocks(block_run.pages, run.lo, run.hi, block_run.block_ids)
            else:
                self._copier.from_blocks(block_run.pages, run.lo, run.hi, block_run.block_ids)
            return
        pages = (
            torch.from_numpy(raw).view(self.paged.dtype).view(run.num_pages, *self.kv_layout.page_shape)
        )  # [n, L, 2, C, H, D]
        # prompt positions of the run, [n, hi - lo]
        positions = (first_chunk + torch.arange(run.num_pages))[:, None] * C + torch.arange(run.lo, run.hi)[None, :]
        slots = slots_of_positions(positions, block_ids, N, self.device)
        window = pages[:, :, :, run.lo : run.hi, self.heads.heads]  # this rank's heads
        for index, layer in enumerate(self.layers):
            if into_kv:
                scatter_tokens(layer, self.paged, window[:, index].transpose(0, 1), slots)  # [2, n, hi - lo, H, D]
            else:
                gather_tokens(layer, self.paged, slots, window[:, index].transpose(0, 1))

    # -- stores --------------------------------------------------------------------

    def start_stores(self, specs: list[StoreSpec]) -> StepStores:
        return CpuStores(self, specs)

    def store_now(self, spec: StoreSpec) -> int:
        """Reserve, fill and commit pages for the spec's chunks; returns how many were committed."""
        client = self.link.client()
        times = PhaseTimes()
        reservation = self.pool.reserve(client, spec, times) if client is not None else None
        if reservation is None:
            return 0
        try:
            self.copy_out(client, spec, reservation.grants)
            times.mark("copy")
            checksums = self.hasher.checksums(
                [client.page(offset, self.kv_layout.page_bytes) for _, offset in reservation.grants]
            )
            times.mark("checksum")
        except Exception as exc:  # a bug in the copy: give the pages back; vLLM keeps serving
            log.error("kvshare: store for request %s failed", spec.req_id, exc_info=True)
            self.pool.abort(client, reservation.reservation_id, exc)
            return 0
        return self.pool.commit(client, spec, reservation, checksums, ChecksumKind.XXH3, times)

    def copy_state_out(self, client, blocks: tuple[int, ...], offset: int) -> tuple[int, ChecksumKind]:
        """The GDN state in ``blocks`` copied into the reserved checkpoint page at ``offset``; its XXH3."""
        page = client.page(offset, self.states.layout.checkpoint_bytes)
        self.states.read(blocks, page)
        return self.hasher.checksums([page], ChecksumKind.XXH3)[0], ChecksumKind.XXH3

    def copy_out(self, client, spec: StoreSpec, grants) -> None:
        """Copy the granted chunks ((index into the spec's keys, page offset) each) out of vLLM's blocks into
        their pages (this rank's heads of them)."""
        C, page_bytes = self.kv_layout.chunk_tokens, self.kv_layout.page_bytes
        slices = [PageSlice(index, spec.first_chunk + index, 0, C) for index, _ in grants]
        offsets = [offset for _, offset in grants]
        for run in copy_runs(slices, offsets, page_bytes, C, client.hello.extent_bytes):
            raw = self._raw(client, offsets[run.first], run)
            self._copy_run(raw, run, slices[run.first].chunk, spec.block_ids, into_kv=False)

    def store_part(self, spec: StoreSpec, may_store: bool) -> StorePart:
        """This rank's heads of a reserved store written into its pages, with their part of each page's
        WSUM32; or why not (which aborts the reservation: no page is ever visible with a head missing)."""
        rank = self.heads.tp_rank
        if not may_store:
            return StorePart(spec.reservation_id, spec.pool_id, rank, False, reason=FAILED_LOAD)
        if not self.heads.is_writer:  # a replicated head another rank writes
            return StorePart(spec.reservation_id, spec.pool_id, rank, True, (0,) * len(spec.grants))
        client, reason = self.pool.client_for(spec.pool_id)
        if client is None:
            return StorePart(spec.reservation_id, spec.pool_id, rank, False, reason=reason)
        try:
            self.copy_out(client, spec, spec.grants)
            page_bytes = self.kv_layout.page_bytes
            sums = tuple(
                partial_wsum32(client.page(offset, page_bytes), self.kv_layout, self.heads) for _, offset in spec.grants
            )
        except Exception as exc:  # a bug in the copy: the reservation is aborted; vLLM keeps serving
            log.error("kvshare: rank %d's part of the store for request %s failed", rank, spec.req_id, exc_info=True)
            return StorePart(spec.reservation_id, spec.pool_id, rank, False, reason=f"{type(exc).__name__}: {exc}")
        return StorePart(spec.reservation_id, spec.pool_id, rank, True, sums)


class BackgroundLoad(StepLoads):
    """One load verified and copied beside vLLM's steps on the loader thread (an asynchronous load): done once
    the thread is through; ``finish`` then settles it on the hooks' thread (a bad page is dropped from the pool
    there), so the pool connection is only ever used by the hooks' thread."""

    def __init__(self, worker: CpuKVWorker, load: PlannedLoad, executor: ThreadPoolExecutor) -> None:
        super().__init__([])
        self.worker, self.load = worker, load
        self._copied = executor.submit(worker.verify_and_copy, load)

    def is_done(self) -> bool:
        return self._copied.done()

    def finish(self) -> tuple[list[LoadOutcome], bool]:
        spec = self.load.spec
        try:
            verdicts = self._copied.result()
        except BaseException as exc:  # the copy failed part way (or never ran): all of it is recomputed
            log.error("kvshare: load for request %s failed", spec.req_id, exc_info=exc)
            reason = f"{type(exc).__name__} while loading beside vLLM's steps: {exc}"
            return [self.worker.outcome(spec, spec.token_start, reason, self.load.times)], True
        return [self.worker.finish_load(self.load, iter(verdicts))], True


class CpuStores(StepStores):
    """A step's stores on CPU: all of them after the forward, in ``finish`` (a saved layer changes nothing)."""

    def __init__(self, worker: CpuKVWorker, specs: list[StoreSpec]) -> None:
        self.worker, self.specs = worker, specs
        self.parts = []

    def finish(self, may_commit: Callable[[StoreSpec], bool]) -> int:
        committed = 0
        for spec in self.specs:
            if spec.is_parted:
                self.parts.append(self.worker.store_part(spec, may_commit(spec)))
            elif may_commit(spec):
                committed += self.worker.store_now(spec)
        return committed
