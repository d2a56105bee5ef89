"""CpuTransfer: pool pages <-> a CPU KV tensor, one torch copy per run of consecutive pages.

The pool side is a zero-copy view of the mapped arena (``torch.from_numpy``),
contiguous by construction and asserted; torch spreads each copy over the
intra-op threads. Every call is complete when it returns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvshare.transfer.base import KVTransfer, LoadHandle
from kvshare.transfer.layouts import as_bits, chunks_to_engine, chunks_view, engine_to_chunks
from kvshare.transfer.plan import PageRun, page_runs
from kvshare.transfer.state import StateLoad, cpu_load_state, cpu_store_state


class CpuTransfer(KVTransfer):
    """Copies between the arena and a CPU ``kv [L, 2, H, T, D]`` with the token/head transpose."""

    @torch.inference_mode()  # kv may be an inference tensor (allocated under inference mode)
    def load(self, kv: torch.Tensor, first_chunk: int, pages: Sequence) -> LoadHandle:
        start = time.perf_counter()
        offsets = self._page_offsets(pages)
        self._check_kv(kv, first_chunk, len(pages))
        # pages are committed and leased, so they cannot change: verify before any byte moves
        self._verify_pages(pages, first_chunk, self._pages_to_verify(len(pages)))
        kv_bits = as_bits(kv)
        first_copy = time.perf_counter()
        for run in page_runs(offsets, self.layout.page_bytes, self.extent_bytes):
            chunks_to_engine(kv_bits, self._run_view(run), (first_chunk + run.first) * self.layout.chunk_tokens)
        return LoadHandle(
            num_bytes=len(pages) * self.layout.page_bytes, seconds=time.perf_counter() - start, first_copy_s=first_copy
        )

    @torch.inference_mode()
    def store(self, kv: torch.Tensor, first_chunk: int, offsets: Sequence[int], producer_stream=None) -> list[int]:
        if producer_stream is not None:
            raise ValueError("a CPU transfer has no producer stream: the KV is ready when store() is called")
        offsets = list(offsets)
        self._check_kv(kv, first_chunk, len(offsets))
        kv_bits = as_bits(kv)
        for run in page_runs(offsets, self.layout.page_bytes, self.extent_bytes):
            engine_to_chunks(self._run_view(run), kv_bits, (first_chunk + run.first) * self.layout.chunk_tokens)
        return self._hasher.checksums([self._page(offset) for offset in offsets], self.checksum_kind)

    @torch.inference_mode()
    def load_state(self, page, into: torch.Tensor) -> StateLoad:
        return cpu_load_state(self, page, into)

    @torch.inference_mode()
    def store_state(self, data: torch.Tensor, offset: int, producer_stream=None) -> int:
        if producer_stream is not None:
            raise ValueError("a CPU transfer has no producer stream: the state is ready when store_state() is called")
        return cpu_store_state(self, data, offset)

    def _run_view(self, run: PageRun) -> torch.Tensor:
        """The run's pages as an integer tensor [n, L, 2, C, H, D] over the arena (no copy)."""
        raw = self.client.page(run.offset, run.num_pages * self.layout.page_bytes)
        assert raw.flags.c_contiguous, "pool views must be contiguous"
        return chunks_view(torch.from_numpy(raw), self.layout, run.num_pages)
