"""The vLLM connector's worker side: copies between pool pages and vLLM's paged KV.

Independent of vLLM (tested with plain tensors): it is given the per-layer KV tensors in
layer order, their PagedLayout, and the specs the scheduler side planned.

``load`` runs before the step's forward and is synchronous: the pages chosen for
verification (every page with ``verify_fraction`` 1, else a share of them that
kvshare.pool.checksum's PageSampler draws) are checked there, before any of their bytes
are used; the first page that fails (checksum, a lease from another pool, a pool gone)
ends the load there, and the tokens from that
point are reported so that vLLM recomputes them. ``begin_load`` plans the same load to be
copied layer by layer beside the forward (kvshare.integrations.vllm.overlap), where the
checksums are only known after the forward read the bytes; the tokens from a bad page on
are reported the same way before the step's output counts. Stores run after the forward: reserve
pages for the chunks, copy each chunk out of vLLM's blocks, checksum, commit. A page is
visible to other replicas only after its commit, and never holds a partial copy.

On CPU, runs of whole blocks move as numpy block copies over ``copy_threads`` threads
(block_copy); anything else as a torch token scatter/gather. On a GPU ("staged") every load and
store goes layer group by layer group through GPU staging buffers with 2-D copies and events
(staging, staged_loads, staged_stores): ``begin_load`` + ``start_layered`` enqueue a step's loads,
``begin_stores`` returns the step's stores, which copy each layer out as vLLM saves it; pages a GPU
writes carry WSUM32 checksums, verified on the GPU by the next GPU reader. A tensor parallel rank
(``heads``) copies only its heads of each page on either path.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from kvshare.integrations.vllm.block_copy import CpuBlockCopier, leave_the_callers_cores
from kvshare.integrations.vllm.layout import PagedLayout, gather_tokens, scatter_tokens, slots_of_positions
from kvshare.integrations.vllm.metadata import ConnectorCounters, LoadOutcome, LoadSpec, PhaseTimes, StoreSpec
from kvshare.integrations.vllm.overlap import BlockRun, LayeredLoad, LayeredLoads
from kvshare.integrations.vllm.plan import CopyRun, PageSlice, copy_runs, page_slices
from kvshare.pool.link import PoolLink
from kvshare.integrations.vllm.pool_pages import PoolPages
from kvshare.integrations.vllm.staged_loads import StagedLoads
from kvshare.integrations.vllm.staged_stores import StagedStores
from kvshare.integrations.vllm.staging import StagingEngine
from kvshare.integrations.vllm.tensor_parallel import HeadSlice
from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind, PageHasher, PageSampler
from kvshare.transfer.base import TransferConfig

log = logging.getLogger("kvshare.integrations")

# the GPU path's copies: 2-D copies (cuda-bindings) of rows >= 2 MiB, two 128 MiB staging buffers per direction
GPU_TRANSFER = TransferConfig(staging_bytes=128 << 20)


class PoolKVWorker:
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
        staging_class: type[StagingEngine] = StagingEngine,
        heads: HeadSlice | None = None,
    ) -> None:
        """``staged``: move KV through GPU staging (None: when the KV tensors are on CUDA; True on CPU
        tensors runs the same path under a fake CUDA, for tests). ``staging_class``: the validation's
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
        self._staging_class = staging_class
        self._staging: StagingEngine | None = None  # on a GPU: streams, staging buffers, the registered arena

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
        if self._staging is not None:
            self._staging.close()
        staged = self.device.type == "cuda" if self._staged is None else self._staged
        if not staged and self.device.type != "cpu":
            raise ValueError(f"KV tensors on {self.device} move through GPU staging only (staged=False needs CPU tensors)")
        self._staging = self._staging_class(self.layers, paged, self.kv_layout, self.transfer, self.heads) \
            if staged else None
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
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        self._hasher.close()
        self.link.close()

    @property
    def copier(self) -> CpuBlockCopier | None:
        return self._copier

    def start_layered(self, loads: list[LayeredLoad], wait_now: bool = False) -> LayeredLoads | StagedLoads:
        """Start copying ``loads`` layer by layer: on a GPU enqueued at once (``wait_now``: vLLM's stream waits
        for all of it here, for a forward that does not wait per layer), on CPU on the loader thread."""
        if self._staging is not None:
            return StagedLoads(self, loads, self._staging, wait_now)
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvshare-load", initializer=leave_the_callers_cores)
        return LayeredLoads(self, loads, self._loader)

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    # -- loads ---------------------------------------------------------------------

    def load(self, spec: LoadSpec) -> LoadOutcome:
        """Copy the spec's tokens into vLLM's blocks; stops at the first page that cannot be trusted.

        On a GPU the same staged path as a step's layered loads, vLLM's stream waiting for all of it."""
        if self._staging is not None:
            layered = self.begin_load(spec)
            if isinstance(layered, LoadOutcome):
                return layered
            outcomes, _ = self.start_layered([layered], wait_now=True).finish()
            return outcomes[0]
        times = PhaseTimes()
        client, reason = self.pool.client_for(spec.pool_id) if spec.pages else (None, "no lease backs the load")
        times.mark("client")
        loaded_end = spec.token_start
        if client is not None:
            try:
                loaded_end, reason = self._copy_in(client, spec, times)
            except Exception as exc:  # a bug or a vanished mapping: recompute, keep serving
                log.error("kvshare: load for request %s failed", spec.req_id, exc_info=True)
                loaded_end, reason = spec.token_start, f"{type(exc).__name__}: {exc}"
        return self.outcome(spec, loaded_end, reason, times)

    def begin_load(self, spec: LoadSpec) -> LayeredLoad | LoadOutcome:
        """A load to copy layer by layer beside the forward (on a GPU: staged_loads; on CPU whole blocks:
        the overlap module), or, where that cannot be, the outcome of loading it now."""
        if self._copier is None and self._staging is None:
            return self.load(spec)
        times = PhaseTimes()
        client, reason = self.pool.client_for(spec.pool_id) if spec.pages else (None, "no lease backs the load")
        if client is None:
            return self.outcome(spec, spec.token_start, reason, times)
        if self._staging is not None:
            pieces, reason = self._pieces(spec)
            if not pieces:
                return self.outcome(spec, spec.token_start, reason, times)
            return LayeredLoad(spec, pieces, [self._sampler.draw() for _ in pieces], reason, times, client=client)
        try:
            if any(spec.pages[i].checksum_kind != ChecksumKind.XXH3 for i in range(len(spec.pages))):
                return self.load(spec)  # the layered CPU copy streams xxh3 only; a GPU-written page loads now
            pieces, reason = self._pieces(spec)
            offsets = [spec.pages[p.page_index].offset for p in pieces]
            runs = copy_runs(pieces, offsets, self.kv_layout.page_bytes, self.kv_layout.chunk_tokens,
                             client.hello.extent_bytes)
            if not pieces or not all(self._copier_takes(pieces[run.first].chunk, run) for run in runs):
                return self.load(spec)  # nothing to copy, or not whole blocks (the token copy): now
            layered = LayeredLoad(spec, pieces, [self._sampler.draw() for _ in pieces], reason, times)
            layered.runs = [self._block_run(client, offsets[run.first], run, pieces[run.first].chunk, spec.block_ids)
                            for run in runs]
        except Exception as exc:
            log.error("kvshare: load for request %s failed", spec.req_id, exc_info=True)
            return self.outcome(spec, spec.token_start, f"{type(exc).__name__}: {exc}", times)
        times.mark("plan")
        return layered

    def outcome(self, spec: LoadSpec, loaded_end: int, reason: str, times: PhaseTimes) -> LoadOutcome:
        """Count and log a finished load; the outcome the scheduler side is told."""
        num_loaded = loaded_end - spec.token_start
        self.counters.loaded_tokens += num_loaded
        self.counters.load_bytes += num_loaded * self.kv_layout.bytes_per_token
        self.counters.load_seconds += times.total
        log.debug("kvshare timing: load %s tokens=%d threads=%d %s", spec.req_id, num_loaded,
                  torch.get_num_threads(), times.line())
        if loaded_end != spec.token_end:
            self.counters.load_failures += 1
            log.warning("kvshare: load for request %s stopped at token %d of %d..%d: %s; vLLM recomputes the rest",
                        spec.req_id, loaded_end, spec.token_start, spec.token_end, reason)
            return LoadOutcome(spec.req_id, spec.token_start, spec.token_end, loaded_end, reason)
        return LoadOutcome(spec.req_id, spec.token_start, spec.token_end, loaded_end)

    def _pieces(self, spec: LoadSpec) -> tuple[list[PageSlice], str]:
        """The page slices a load may copy, and why it ends before the spec does ("" if it need not)."""
        C, page_bytes = self.kv_layout.chunk_tokens, self.kv_layout.page_bytes
        covered_end = min(spec.token_end, (spec.first_chunk + len(spec.pages)) * C)
        if spec.token_start < spec.first_chunk * C or covered_end <= spec.token_start:
            return [], "no leased page covers the load"
        pieces = page_slices(spec.token_start, covered_end, spec.first_chunk, len(spec.pages), C)
        for index, piece in enumerate(pieces):  # read no further than a page of another size: not this model's
            if spec.pages[piece.page_index].page_bytes != page_bytes:
                size = spec.pages[piece.page_index].page_bytes
                return pieces[:index], f"page of {size} bytes, this model's pages have {page_bytes}"
        return pieces, ""

    def settle(self, spec: LoadSpec, pieces: list[PageSlice], chosen: list[bool], verdicts: Iterator[bool],
               reason: str) -> tuple[int, str]:
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

    def _copy_in(self, client, spec: LoadSpec, times: PhaseTimes) -> tuple[int, str]:
        """Verify, then copy; returns (end of the tokens copied, why it stopped early or "")."""
        page_bytes, C = self.kv_layout.page_bytes, self.kv_layout.chunk_tokens
        pieces, reason = self._pieces(spec)
        if not pieces:
            return spec.token_start, reason
        # the draws in page order; the chosen pages checked all at once, spread over the hashing threads
        # (checksumming each page and copying it right after, while in cache, measured slower: 15-20 ms
        # against 11-13 ms for 8k tokens, cold caches or not)
        chosen = [self._sampler.draw() for _ in pieces]
        refs = [spec.pages[p.page_index] for p, c in zip(pieces, chosen) if c]
        verdicts = self._hasher.valid([client.page(ref.offset, page_bytes) for ref in refs], refs)
        loaded_end, reason = self.settle(spec, pieces, chosen, iter(verdicts), reason)
        times.mark("verify")
        trusted = [p for p in pieces if p.chunk * C + p.lo < loaded_end]
        offsets = [spec.pages[p.page_index].offset for p in trusted]
        for run in copy_runs(trusted, offsets, page_bytes, C, client.hello.extent_bytes):
            self._copy_run(client, offsets[run.first], run, trusted[run.first].chunk, spec.block_ids, into_kv=True)
        times.mark("copy")
        return loaded_end, reason

    def _copier_takes(self, first_chunk: int, run: CopyRun) -> bool:
        """Whether the CPU block copier can move the run: it starts and ends on block boundaries."""
        N = self.paged.block_size
        return self._copier is not None and (first_chunk * self.kv_layout.chunk_tokens + run.lo) % N == 0 \
            and run.hi % N == 0

    def _block_run(self, client, offset: int, run: CopyRun, first_chunk: int, block_ids) -> BlockRun:
        """The run's pages as a [n, L, 2, C, H, D] view of the arena and the vLLM blocks its tokens go to."""
        N = self.paged.block_size
        raw = client.run(offset, self.kv_layout.page_bytes, run.num_pages).view(self._copier.dtype)
        pages = raw.reshape(run.num_pages, *self.kv_layout.page_shape)
        first_block = (first_chunk * self.kv_layout.chunk_tokens + run.lo) // N
        num_blocks = run.num_pages * (run.hi - run.lo) // N
        return BlockRun(run, pages, block_ids[first_block : first_block + num_blocks])

    def _copy_run(self, client, offset: int, run: CopyRun, first_chunk: int, block_ids, into_kv: bool) -> None:
        """Tokens ``run.lo .. run.hi - 1`` of the run's pages (chunks ``first_chunk ..``) into vLLM's blocks
        (``into_kv``) or out of them into the pages (CPU: whole blocks, or tokens)."""
        C, N = self.kv_layout.chunk_tokens, self.paged.block_size
        if self._copier_takes(first_chunk, run):
            block_run = self._block_run(client, offset, run, first_chunk, block_ids)
            if into_kv:
                self._copier.to_blocks(block_run.pages, run.lo, run.hi, block_run.block_ids)
            else:
                self._copier.from_blocks(block_run.pages, run.lo, run.hi, block_run.block_ids)
            return
        raw = torch.from_numpy(client.run(offset, self.kv_layout.page_bytes, run.num_pages))
        pages = raw.view(self.paged.dtype).view(run.num_pages, *self.kv_layout.page_shape)  # [n, L, 2, C, H, D]
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

    def store(self, spec: StoreSpec) -> int:
        """Reserve, fill and commit pages for the spec's chunks; returns how many were committed.

        On a GPU the staged path of a step's stores, every layer copied out after vLLM's current stream."""
        if self._staging is not None:
            stores = self.begin_stores([spec])
            if stores is None:
                return 0
            for index in range(self.kv_layout.num_layers):
                stores.save_layer(index)
            return stores.finish(lambda _: True)
        client = self.link.client()
        times = PhaseTimes()
        reservation = self.pool.reserve(client, spec, times) if client is not None else None
        if reservation is None:
            return 0
        try:
            self.copy_out(client, spec, reservation.grants)
            times.mark("copy")
            checksums = self._hasher.checksums([client.page(offset, self.kv_layout.page_bytes)
                                                for _, offset in reservation.grants])
            times.mark("checksum")
        except Exception as exc:  # a bug in the copy: give the pages back; vLLM keeps serving
            log.error("kvshare: store for request %s failed", spec.req_id, exc_info=True)
            self.pool.abort(client, reservation.reservation_id, exc)
            return 0
        return self.pool.commit(client, spec, reservation, checksums, ChecksumKind.XXH3, times)

    def begin_stores(self, specs: list[StoreSpec]) -> StagedStores | None:
        """A step's stores on a GPU: save_layer per layer, then finish. None when there are none, or the pool
        is unreachable and no spec is a tensor parallel part (a part is reported even then: not written)."""
        client = self.link.client()
        if not specs or (client is None and not any(spec.is_parted for spec in specs)):
            return None
        return StagedStores(self.pool, specs, self._staging, client)

    def copy_out(self, client, spec: StoreSpec, grants) -> None:
        """Copy the granted chunks ((index into the spec's keys, page offset) each) out of vLLM's blocks into
        their pages (this rank's heads of them)."""
        C, page_bytes = self.kv_layout.chunk_tokens, self.kv_layout.page_bytes
        slices = [PageSlice(index, spec.first_chunk + index, 0, C) for index, _ in grants]
        offsets = [offset for _, offset in grants]
        for run in copy_runs(slices, offsets, page_bytes, C, client.hello.extent_bytes):
            self._copy_run(client, offsets[run.first], run, slices[run.first].chunk, spec.block_ids, into_kv=False)
