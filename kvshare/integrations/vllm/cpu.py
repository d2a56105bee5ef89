"""The worker side's copies on CPU: loads verified then copied before the forward, stores after it.

``load`` runs before the step's forward and is synchronous: the pages chosen for verification
(every page with ``verify_fraction`` 1, else a share of them that kvshare.pool.checksum's
PageSampler draws) are checked there, before any of their bytes are used; the first page that
fails (checksum, a lease from another pool, a pool gone) ends the load there, and the tokens from
that point are reported so that vLLM recomputes them. Stores run after the forward: reserve pages
for the chunks, copy each chunk out of vLLM's blocks, checksum, commit. A page is visible to other
replicas only after its commit, and never holds a partial copy. Runs of whole blocks move as numpy
block copies over ``copy_threads`` threads (block_copy); anything else as a torch token
scatter/gather. A tensor parallel rank (``heads``) copies only its heads of each page
(``store_part``: its part of a reserved store, tensor_parallel).

``CpuCopies`` is the CPU half of ``worker.PoolKVWorker``; ``load`` and ``store`` also take the GPU
path there (the staged copies of kvshare.integrations.vllm.gpu, waited for at once).
"""

from __future__ import annotations

import logging

import torch

from kvshare.integrations.vllm.counters import PhaseTimes
from kvshare.integrations.vllm.layout import gather_tokens, scatter_tokens, slots_of_positions
from kvshare.integrations.vllm.metadata import LoadOutcome, LoadSpec, StorePart, StoreSpec
from kvshare.integrations.vllm.overlap import BlockRun
from kvshare.integrations.vllm.page_slices import CopyRun, PageSlice, copy_runs, load_pieces
from kvshare.integrations.vllm.tensor_parallel import partial_wsum32
from kvshare.pool.checksum import ChecksumKind

log = logging.getLogger("kvshare.integrations")


class CpuCopies:
    """PoolKVWorker's synchronous loads and stores and its copies on CPU (the state is PoolKVWorker's)."""

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

    def _copy_in(self, client, spec: LoadSpec, times: PhaseTimes) -> tuple[int, str]:
        """Verify, then copy; returns (end of the tokens copied, why it stopped early or "")."""
        page_bytes, C = self.kv_layout.page_bytes, self.kv_layout.chunk_tokens
        pieces, reason = load_pieces(spec, self.kv_layout)
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
        return (
            self._copier is not None
            and (first_chunk * self.kv_layout.chunk_tokens + run.lo) % N == 0
            and run.hi % N == 0
        )

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
            checksums = self._hasher.checksums(
                [client.page(offset, self.kv_layout.page_bytes) for _, offset in reservation.grants]
            )
            times.mark("checksum")
        except Exception as exc:  # a bug in the copy: give the pages back; vLLM keeps serving
            log.error("kvshare: store for request %s failed", spec.req_id, exc_info=True)
            self.pool.abort(client, reservation.reservation_id, exc)
            return 0
        return self.pool.commit(client, spec, reservation, checksums, ChecksumKind.XXH3, times)

    def copy_out(self, client, spec: StoreSpec, grants) -> None:
        """Copy the granted chunks ((index into the spec's keys, page offset) each) out of vLLM's blocks into
        their pages (this rank's heads of them)."""
        C, page_bytes = self.kv_layout.chunk_tokens, self.kv_layout.page_bytes
        slices = [PageSlice(index, spec.first_chunk + index, 0, C) for index, _ in grants]
        offsets = [offset for _, offset in grants]
        for run in copy_runs(slices, offsets, page_bytes, C, client.hello.extent_bytes):
            self._copy_run(client, offsets[run.first], run, slices[run.first].chunk, spec.block_ids, into_kv=False)

    def store_part(self, spec: StoreSpec, may_store: bool) -> StorePart:
        """This rank's heads of a reserved store written into its pages, with their part of each page's
        WSUM32; or why not (which aborts the reservation: no page is ever visible with a head missing)."""
        worker, rank = self, self.heads.tp_rank
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
            sums = tuple(
                partial_wsum32(client.page(offset, page_bytes), worker.kv_layout, worker.heads)
                for _, offset in spec.grants
            )
        except Exception as exc:  # a bug in the copy: the reservation is aborted; vLLM keeps serving
            log.error("kvshare: rank %d's part of the store for request %s failed", rank, spec.req_id, exc_info=True)
            return StorePart(spec.reservation_id, spec.pool_id, rank, False, reason=f"{type(exc).__name__}: {exc}")
        return StorePart(spec.reservation_id, spec.pool_id, rank, True, sums)
