"""The vLLM connector's worker side: copies between pool pages and vLLM's paged KV.

Independent of vLLM (tested with plain tensors): it is given the per-layer KV tensors in
layer order, their PagedLayout, and the specs the scheduler side planned.

``load`` runs before the step's forward and is synchronous: the pages chosen for
verification (every page with ``verify_fraction`` 1, else a random share of them) are
checked before any of their bytes are used; the first page that fails (checksum, a
lease from another pool, a pool gone) ends the load there, and the tokens from that
point are reported so that vLLM recomputes them. ``begin_load`` plans the same load to be
copied layer by layer beside the forward (kvshare.integrations.vllm.overlap), where the
checksums are only known after the forward read the bytes; the tokens from a bad page on
are reported the same way before the step's output counts. Stores run after the forward: reserve
pages for the chunks, copy each chunk out of vLLM's blocks, checksum, commit. A page is
visible to other replicas only after its commit, and never holds a partial copy.

On CPU, runs of whole blocks move as numpy block copies over ``copy_threads`` threads
(block_copy); anything else, and every copy on CUDA, as a torch token scatter/gather.
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
from kvshare.integrations.vllm.pool_link import POOL_DOWN_ERRORS, PoolLink
from kvshare.layout import KVLayout
from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolRequestError

log = logging.getLogger("kvshare.integrations")


class PoolKVWorker:
    """Moves KV between the pool and one vLLM worker's paged KV tensors."""

    def __init__(
        self,
        kv_layout: KVLayout,
        link: PoolLink,
        verify_fraction: float = 1.0,
        copy_threads: int = 1,
        rng: random.Random | None = None,
    ) -> None:
        if not 0.0 <= verify_fraction <= 1.0:
            raise ValueError(f"verify_fraction must lie in [0, 1], got {verify_fraction}")
        self.kv_layout = kv_layout
        self.link = link
        self.verify_fraction = verify_fraction
        self.copy_threads = copy_threads
        self.counters = ConnectorCounters()
        self.layers: list[torch.Tensor] = []
        self.paged: PagedLayout | None = None
        self._copier: CpuBlockCopier | None = None  # on CPU: whole-block copies
        self._rng = rng or random.Random()  # which pages a sampled verification checks
        self._loader: ThreadPoolExecutor | None = None  # on CPU: the thread that copies loads beside the forward
        self._registration = None  # on CUDA: the pinned arena (kvshare.transfer.registration)
        self._registered_arena = None  # keeps that mapping alive while it is registered

    def register(self, layers: list[torch.Tensor], paged: PagedLayout) -> None:
        """vLLM's KV tensors, one per model layer in layer order, all in layout ``paged``."""
        if len(layers) != self.kv_layout.num_layers:
            raise ValueError(f"vLLM registered {len(layers)} KV layers, the model has {self.kv_layout.num_layers}")
        self.layers = list(layers)
        self.paged = paged
        if self._copier is not None:
            self._copier.close()
        self._copier = CpuBlockCopier(self.layers, paged, self.copy_threads) if self.device.type == "cpu" else None

    def prepare(self) -> None:
        """Connect now (and pin the arena on CUDA) so the first request does not pay for it."""
        client = self.link.client()
        if client is not None:
            try:
                self._pin(client)
            except Exception:  # the first copy raises it again, where it is reported as a failed copy
                log.error("kvshare: pinning the pool arena for CUDA failed", exc_info=True)

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        self.link.close()

    @property
    def copier(self) -> CpuBlockCopier | None:
        return self._copier

    def start_layered(self, loads: list[LayeredLoad]) -> LayeredLoads:
        """Start copying ``loads`` layer by layer on the loader thread (off the caller's core)."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvshare-load", initializer=leave_the_callers_cores)
        return LayeredLoads(self, loads, self._loader)

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def _pin(self, client) -> None:
        """On CUDA, register the client's arena once per mapping, so copies run at pinned speed.

        A failed registration raises (the copy is then reported failed): never a silent
        fall back to pageable memory. Copies never span two registrations (copy_runs splits
        runs at extent boundaries).
        """
        if self.device.type != "cuda" or self._registered_arena is client.arena:
            return
        from kvshare.transfer.registration import acquire_registration, release_registration

        if self._registration is not None:
            registration, self._registration, self._registered_arena = self._registration, None, None
            release_registration(registration)
        self._registration = acquire_registration(client)
        self._registered_arena = client.arena
        log.info("kvshare: pinned the pool arena for CUDA copies (%.2f s)", self._registration.seconds)

    def _pages(self, client, offset: int, num_pages: int) -> torch.Tensor:
        """Consecutive pool pages as a [n, L, 2, C, H, D] tensor (a zero-copy view of the arena)."""
        raw = torch.from_numpy(client.run(offset, self.kv_layout.page_bytes, num_pages))
        return raw.view(self.paged.dtype).view(num_pages, *self.kv_layout.page_shape)

    # -- loads ---------------------------------------------------------------------

    def load(self, spec: LoadSpec) -> LoadOutcome:
        """Copy the spec's tokens into vLLM's blocks; stops at the first page that cannot be trusted."""
        times = PhaseTimes()
        client, reason = self._client_for(spec.pool_pid) if spec.pages else (None, "no lease backs the load")
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
        """A load to copy layer by layer beside the forward (CPU, whole blocks: the overlap
        module runs it), or, where that cannot be, the outcome of loading it now."""
        if self._copier is None:
            return self.load(spec)
        times = PhaseTimes()
        client, reason = self._client_for(spec.pool_pid) if spec.pages else (None, "no lease backs the load")
        if client is None:
            return self.outcome(spec, spec.token_start, reason, times)
        try:
            pieces, reason = self._pieces(spec)
            offsets = [spec.pages[p.page_index].offset for p in pieces]
            runs = copy_runs(pieces, offsets, self.kv_layout.page_bytes, self.kv_layout.chunk_tokens,
                             client.hello.extent_bytes)
            if not pieces or not all(self._copier_takes(pieces[run.first].chunk, run) for run in runs):
                return self.load(spec)  # nothing to copy, or not whole blocks (the token copy): now
            layered = LayeredLoad(spec, pieces, [self._draw_verification() for _ in pieces], reason, times)
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

    def settle(self, spec: LoadSpec, pieces: list[PageSlice], chosen: list[bool], sums: Iterator[int],
               reason: str) -> tuple[int, str]:
        """Where a load's trusted tokens end: at the first chosen page whose checksum (next of ``sums``, one
        per chosen page in order) differs from the pool's, which is then dropped from the pool."""
        trusted = 0
        for piece, is_chosen in zip(pieces, chosen):
            ref = spec.pages[piece.page_index]
            if is_chosen:
                self.counters.verified_pages += 1
                if next(sums) != ref.checksum:
                    self.counters.checksum_failures += 1
                    self._drop(spec.keys[piece.page_index])
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
        # the draws in page order; the chosen pages' checksums all at once, spread over the copy threads
        # (checksumming each page and copying it right after, while in cache, measured slower: 15-20 ms
        # against 11-13 ms for 8k tokens, cold caches or not)
        chosen = [self._draw_verification() for _ in pieces]
        views = [client.page(spec.pages[p.page_index].offset, page_bytes) for p, c in zip(pieces, chosen) if c]
        loaded_end, reason = self.settle(spec, pieces, chosen, iter(self._checksums(views)), reason)
        times.mark("verify")
        trusted = [p for p in pieces if p.chunk * C + p.lo < loaded_end]
        offsets = [spec.pages[p.page_index].offset for p in trusted]
        self._pin(client)
        for run in copy_runs(trusted, offsets, page_bytes, C, client.hello.extent_bytes):
            self._copy_run(client, offsets[run.first], run, trusted[run.first].chunk, spec.block_ids, into_kv=True)
        times.mark("copy")
        return loaded_end, reason

    def _checksums(self, pages: list) -> list[int]:
        """``page_checksum`` of each page; on CPU spread over the copy threads (xxhash releases the GIL)."""
        if self._copier is not None:
            return self._copier.map(page_checksum, pages)
        return [page_checksum(page) for page in pages]

    def _draw_verification(self) -> bool:
        """Whether a page's checksum is checked: always at 1.0, else with that probability (random, so a
        bad page cannot hide at a position that is never checked)."""
        return self.verify_fraction >= 1.0 or self._rng.random() < self.verify_fraction

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
        (``into_kv``) or out of them into the pages."""
        C, N = self.kv_layout.chunk_tokens, self.paged.block_size
        if self._copier_takes(first_chunk, run):
            block_run = self._block_run(client, offset, run, first_chunk, block_ids)
            if into_kv:
                self._copier.to_blocks(block_run.pages, run.lo, run.hi, block_run.block_ids)
            else:
                self._copier.from_blocks(block_run.pages, run.lo, run.hi, block_run.block_ids)
            return
        pages = self._pages(client, offset, run.num_pages)  # [n, L, 2, C, H, D]
        # prompt positions of the run, [n, hi - lo]
        positions = (first_chunk + torch.arange(run.num_pages))[:, None] * C + torch.arange(run.lo, run.hi)[None, :]
        slots = slots_of_positions(positions, block_ids, N, self.device)
        if into_kv:
            src = pages[:, :, :, run.lo : run.hi].to(self.device)  # no copy on CPU
            for index, layer in enumerate(self.layers):
                scatter_tokens(layer, self.paged, src[:, index].transpose(0, 1), slots)  # [2, n, hi - lo, H, D]
            return
        window = pages[:, :, :, run.lo : run.hi]
        staging = window if self.device.type == "cpu" else torch.empty(window.shape, dtype=window.dtype, device=self.device)
        for index, layer in enumerate(self.layers):
            gather_tokens(layer, self.paged, slots, staging[:, index].transpose(0, 1))  # [2, n, hi - lo, H, D]
        if staging is not window:
            window.copy_(staging)  # device -> host; synchronous, after the forward's kernels

    def _client_for(self, pool_pid: int):
        """The client mapped onto the arena of the pool ``pool_pid`` (reconnecting once), or (None, why)."""
        client = self.link.client()
        if client is not None and self.link.pool_pid != pool_pid:
            client = self.link.reconnect_now()  # the pool was restarted since our last call
        if client is None:
            return None, "the pool is unreachable"
        if self.link.pool_pid != pool_pid:
            return None, f"lease lost: it came from pool pid {pool_pid}, the pool now is pid {self.link.pool_pid}"
        return client, ""

    def _drop(self, key: bytes) -> None:
        """Remove a chunk found bad from the pool so nobody else loads it."""
        client = self.link.client()
        if client is None:
            return
        try:
            client.drop([key])
        except POOL_DOWN_ERRORS as exc:
            self.counters.pool_errors += 1
            self.link.failed(exc)
        except PoolRequestError as exc:
            self.counters.pool_errors += 1
            log.warning("kvshare: the pool refused to drop a bad chunk: %s", exc)

    # -- stores --------------------------------------------------------------------

    def store(self, spec: StoreSpec) -> int:
        """Reserve, fill and commit pages for the spec's chunks; returns how many were committed."""
        client = self.link.client()
        if client is None or not spec.keys:
            return 0
        times = PhaseTimes()
        try:
            reservation = client.reserve(spec.namespace, list(spec.keys), self.kv_layout.page_bytes, spec.first_chunk)
        except POOL_DOWN_ERRORS as exc:
            self.counters.pool_errors += 1
            self.link.failed(exc)
            return 0
        except PoolRequestError as exc:
            self.counters.pool_errors += 1
            log.warning("kvshare: the pool refused a reserve: %s", exc)
            return 0
        self.counters.skipped_stores += reservation.num_no_room
        times.mark("reserve")
        if not reservation.grants:
            return 0
        try:
            checksums = self._copy_out(client, spec, reservation.grants, times)
            committed = client.commit(reservation.reservation_id, checksums)
            times.mark("commit")
        except (PoolRequestError, *POOL_DOWN_ERRORS) as exc:
            self._abort(client, reservation.reservation_id, exc)
            return 0
        except Exception as exc:  # a bug in the copy: give the pages back; vLLM keeps serving
            log.error("kvshare: store for request %s failed", spec.req_id, exc_info=True)
            self._abort(client, reservation.reservation_id, exc)
            return 0
        self.counters.stored_chunks += committed
        self.counters.store_bytes += committed * self.kv_layout.page_bytes
        self.counters.store_seconds += times.total
        log.debug("kvshare timing: store %s chunks=%d %s", spec.req_id, committed, times.line())
        return committed

    def _copy_out(self, client, spec: StoreSpec, grants: list[tuple[int, int]], times: PhaseTimes) -> list[int]:
        """Copy the granted chunks out of vLLM's blocks into their pages; one checksum per grant, in order."""
        C, page_bytes = self.kv_layout.chunk_tokens, self.kv_layout.page_bytes
        slices = [PageSlice(index, spec.first_chunk + index, 0, C) for index, _ in grants]
        offsets = [offset for _, offset in grants]
        self._pin(client)
        for run in copy_runs(slices, offsets, page_bytes, C, client.hello.extent_bytes):
            self._copy_run(client, offsets[run.first], run, slices[run.first].chunk, spec.block_ids, into_kv=False)
        times.mark("copy")
        checksums = self._checksums([client.page(offset, page_bytes) for offset in offsets])
        times.mark("checksum")
        return checksums

    def _abort(self, client, reservation_id: int, exc: BaseException) -> None:
        self.counters.pool_errors += 1
        log.warning("kvshare: store failed (%s: %s); its pages are aborted", type(exc).__name__, exc)
        if isinstance(exc, POOL_DOWN_ERRORS):
            self.link.failed(exc)
            return  # the daemon aborts a lost client's reservations itself
        try:
            client.abort(reservation_id)
        except POOL_DOWN_ERRORS as abort_exc:
            self.link.failed(abort_exc)
        except PoolRequestError:
            pass
