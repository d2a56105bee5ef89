"""The transfer interface: move chunks between the pool's pages and an engine's KV tensor.

An engine holds one sequence KV tensor ``kv [L, 2, H, T_cap, D]``; chunk j of
the request is tokens ``[j*C, (j+1)*C)``. A pool page holds one chunk in the
canonical order ``[L, 2, C, H, D]``; the transfer converts (a transpose of the
token and head axes) at the copy. Implementations: ``CpuTransfer`` (done when a
call returns) and ``CudaTransfer`` (a copy stream, events, a registered arena).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind, PageHasher, PageSampler
from kvshare.pool.client import ChecksumMismatch
from kvshare.transfer.layouts import torch_dtype

if TYPE_CHECKING:
    import numpy as np

    from kvshare.pool.client import PoolClient
    from kvshare.pool.protocol import PageHeader
    from kvshare.transfer.state import StateLoad

COPY_METHODS = ("memcpy2d", "torch")
LOAD_ENQUEUE_MODES = ("eager", "lazy", "thread")
LAZY_GROUPS_AHEAD = 2  # "lazy": layer groups enqueued beyond the one the compute is about to read


class ChunkChecksumMismatch(ChecksumMismatch):
    """A loaded page failed its checksum; ``chunk_index`` is the request's chunk it held."""

    def __init__(self, chunk_index: int, offset: int) -> None:
        super().__init__(f"chunk {chunk_index} (page at arena offset {offset}) does not match its checksum")
        self.chunk_index = chunk_index
        self.offset = offset


@dataclass(frozen=True)
class TransferConfig:
    """How KV moves between the pool and a device. Values found at run time live on the transfer."""

    # CUDA: "memcpy2d" moves a layer group across a run of pages with one cudaMemcpy2DAsync
    # (needs cuda-bindings); "torch" makes one torch copy per page and layer group. No fallback.
    copy_method: str = "memcpy2d"
    min_copy_bytes: int = 2 << 20  # CUDA: layers are grouped so one page's row of a copy is at least this
    staging_bytes: int = 256 << 20  # CUDA: each GPU staging buffer
    staging_buffers: int = 2  # CUDA: buffers the units rotate through; a copy into one waits for its last scatter
    verify_fraction: float = 0.0  # share of loaded pages whose checksum is checked (client.verify_checksums: all)
    checksum_threads: int = 0  # threads hashing pages (xxhash releases the GIL); 0: min(8, cores)
    producer_delay_cycles: int = 0  # validation: GPU sleep that inject_producer_delay() enqueues
    load_delay_cycles: int = 0  # validation: GPU sleep on the copy stream before a load's copies
    # CUDA: when a load's copies are enqueued. "eager": all in load(); then compute enqueued after the
    # whole load waited for it on the H200. "lazy": a few layer groups ahead of the compute, from
    # wait_layer (the caller's thread). "thread": by a thread, while the caller enqueues its compute.
    load_enqueue: str = "thread"

    def __post_init__(self) -> None:
        if self.copy_method not in COPY_METHODS:
            raise ValueError(f"copy_method must be one of {COPY_METHODS}, got {self.copy_method!r}")
        for name in ("min_copy_bytes", "staging_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be positive, got {getattr(self, name)}")
        if self.staging_buffers < 2:  # one buffer would serialise every copy behind its own scatter
            raise ValueError(f"TransferConfig.staging_buffers must be >= 2, got {self.staging_buffers}")
        if self.load_enqueue not in LOAD_ENQUEUE_MODES:
            raise ValueError(f"load_enqueue must be one of {LOAD_ENQUEUE_MODES}, got {self.load_enqueue!r}")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"verify_fraction must lie in [0, 1], got {self.verify_fraction}")
        for name in ("checksum_threads", "producer_delay_cycles", "load_delay_cycles"):
            if getattr(self, name) < 0:
                raise ValueError(f"TransferConfig.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def num_checksum_threads(self) -> int:
        return self.checksum_threads or min(8, os.cpu_count() or 1)


class LoadHandle:
    """Completion of one load. This base class stands for a load that finished before it was returned."""

    def __init__(self, num_bytes: int, seconds: float | None = None, first_copy_s: float | None = None) -> None:
        self.num_bytes = num_bytes
        self.seconds = seconds  # copy time, once known (CPU: at once; CUDA: after wait_all)
        self.first_copy_s = first_copy_s  # perf_counter() when the first copy was enqueued (a request's timeline)

    def wait_layer(self, layer: int) -> None:
        """Make the current (compute) stream wait until ``layer`` is in the KV tensor."""

    def wait_all(self) -> None:
        """Block until every copy has finished: the pages' lease may be released after this."""

    def verify(self) -> None:
        """Raise ChunkChecksumMismatch (the first bad page) when a check that ran beside the copies failed.

        Waits for the copies and checks. A transfer that checks pages before copying them (CPU) raised in
        load() already; here there is nothing left to check.
        """


class KVTransfer(ABC):
    """Moves chunks between pool pages and one engine's KV tensor. One caller at a time.

    ``checksum_kind`` is the kind of the checksums ``store`` returns, to be committed with them
    (``state_checksum_kind``: ``store_state``'s).
    """

    checksum_kind = ChecksumKind.XXH3
    state_checksum_kind = ChecksumKind.XXH3

    def __init__(self, layout: KVLayout, client: PoolClient, device: torch.device, config: TransferConfig) -> None:
        if client.arena is None:
            raise ValueError("the pool client is not connected (no arena mapped)")
        self.layout = layout
        self.client = client
        self.device = torch.device(device)
        self.config = config
        self.dtype = torch_dtype(layout.dtype)
        self.extent_bytes: int = client.hello.extent_bytes
        self._sampler = PageSampler(config.verify_fraction)
        self._hasher = PageHasher(config.num_checksum_threads)

    @abstractmethod
    def load(self, kv: torch.Tensor, first_chunk: int, pages: Sequence[PageHeader]) -> LoadHandle:
        """Copy page i into kv[:, :, :, (first_chunk+i)*C : (first_chunk+i+1)*C, :].

        Pages chosen for verification are checked by their recorded kind, before the copy (raising
        ChunkChecksumMismatch here) or beside it (reported by the handle's ``verify``)."""

    @abstractmethod
    def load_state(self, page: PageHeader, into: torch.Tensor) -> StateLoad:
        """Copy a state checkpoint's page into ``into`` (the live GDN state's bytes, kvshare.transfer.state), checked
        as a KV page is; enqueue it before the KV pages it goes with (the first layer reads it first)."""

    @abstractmethod
    def store_state(self, data: torch.Tensor, offset: int, producer_stream=None) -> int:
        """Copy a checkpoint's bytes into the reserved page at ``offset`` after the producer's work; its checksum (of
        ``state_checksum_kind``), known once the copy completed."""

    @abstractmethod
    def store(self, kv: torch.Tensor, first_chunk: int, offsets: Sequence[int], producer_stream=None) -> list[int]:
        """Copy chunks first_chunk.. into the (reserved) pages at ``offsets`` after the producer's work;
        return one checksum per page (of ``checksum_kind``), known once the copies completed. Commit only after
        this returns."""

    def inject_producer_delay(self, stream=None) -> None:  # noqa: B027 (a no-op where there is no producer stream)
        """Validation hook: enqueue ``config.producer_delay_cycles`` of GPU sleep on the producer stream.

        A producer calls it before writing the KV it will store; no-op on CPU or when the delay is 0.
        """

    def sync(self) -> None:  # noqa: B027 (a no-op where copies end with their calls)
        """Wait until every copy this transfer enqueued has ended: before a failure path gives the pages
        (or the arena's registration) up. Every CPU copy has ended when its call returns."""

    def close(self) -> None:
        self._hasher.close()

    def __enter__(self) -> KVTransfer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- checks shared by the implementations ----------------------------------------------------

    def _check_kv(self, kv: torch.Tensor, first_chunk: int, num_chunks: int) -> None:
        lay = self.layout
        expected = (lay.num_layers, 2, lay.num_kv_heads, lay.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != expected:
            raise ValueError(
                f"kv must be [L, 2, H, T, D] = [{expected[0]}, 2, {expected[2]}, T, {expected[3]}], "
                f"got {tuple(kv.shape)}"
            )
        if kv.dtype != self.dtype:
            raise ValueError(f"kv dtype {kv.dtype} does not match the layout's {self.dtype}")
        if kv.device.type != self.device.type:
            raise ValueError(f"kv is on {kv.device}, this transfer moves to {self.device}")
        end = (first_chunk + num_chunks) * lay.chunk_tokens
        if first_chunk < 0 or end > kv.shape[3]:
            raise ValueError(
                f"chunks {first_chunk}..{first_chunk + num_chunks - 1} need {end} tokens, kv holds {kv.shape[3]}"
            )

    def _page_offsets(self, pages: Sequence[PageHeader]) -> list[int]:
        from kvshare.pool.protocol import FORMAT_VERSION

        page_bytes = self.layout.page_bytes  # once: a property chain, and a 256k load has 1023 pages
        for page in pages:
            if page.page_bytes != page_bytes:
                raise ValueError(f"page at {page.offset} holds {page.page_bytes} bytes, the layout {page_bytes}")
            if page.format_version != FORMAT_VERSION:
                raise ChecksumMismatch(
                    f"page at {page.offset} has format {page.format_version}, expected {FORMAT_VERSION}"
                )
        return [page.offset for page in pages]

    def _pages_to_verify(self, num_pages: int) -> list[int]:
        """Indices of the pages whose checksum this load checks (all, or a share of them: PageSampler)."""
        if self.client.verify_checksums:
            return list(range(num_pages))
        return self._sampler.choose(num_pages)

    def _page(self, offset: int) -> np.ndarray:
        """Zero-copy view of the page at ``offset`` in the arena."""
        return self.client.page(offset, self.layout.page_bytes)

    def _verify_pages(self, pages: Sequence[PageHeader], first_chunk: int, indices: list[int]) -> None:
        """Raise ChunkChecksumMismatch for the first of the pages at ``indices`` whose bytes are not valid."""
        if not indices:
            return
        valid = self._hasher.valid([self._page(pages[i].offset) for i in indices], [pages[i] for i in indices])
        for i, is_good in zip(indices, valid):
            if not is_good:
                raise ChunkChecksumMismatch(first_chunk + i, pages[i].offset)
