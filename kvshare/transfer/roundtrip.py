"""One store-then-load round trip of random KV over pool pages, what it checks, and how it is set up.

The piece the byte check's paths share: the CPU path (``bytecheck.run_bytecheck``) and the
CUDA paths with their ordering checks (``ordercheck.cuda_checks``) both run ``round_trip``
and report a ``PathResult`` each; ``ByteCheckConfig`` sets them up. Per case (name,
first chunk, page offsets):

- store: the pages written are canonical, byte-equal to the slow reference converter
  (a sample of ``reference_pages`` pages), and the returned checksums match them;
- load into a sentinel-filled kv: the loaded chunks equal the stored ones, and every
  byte outside them still holds the sentinel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvshare.layout import KVLayout
from kvshare.pool.checksum import is_valid
from kvshare.pool.protocol import PageHeader
from kvshare.transfer.base import ChunkChecksumMismatch, TransferConfig
from kvshare.transfer.layouts import as_bits, torch_dtype
from kvshare.transfer.reference import page_bytes_of, reference_engine_to_pages

DEFAULT_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=32)  # 64 KiB pages
SENTINEL = 0x5A


@dataclass(frozen=True)
class PathResult:
    """One path's (or one ordering check's) outcome."""

    path: str  # e.g. "cpu", "cuda/memcpy2d", "cuda/memcpy2d store-order"
    kind: str  # "round_trip" | "ordering" | "control" (a deliberately broken variant that must be caught)
    num_cases: int
    bytes_checked: int
    mismatched_bytes: int
    seconds: float
    skipped: str = ""  # why the path did not run on this machine ("" when it ran)
    detail: str = ""

    @property
    def caught(self) -> bool:
        return self.mismatched_bytes > 0

    @property
    def passed(self) -> bool:
        if self.skipped:
            return True
        if self.kind == "control":
            return self.caught
        return self.bytes_checked > 0 and self.mismatched_bytes == 0


@dataclass(frozen=True)
class ByteCheckConfig:
    layout: KVLayout = DEFAULT_LAYOUT
    max_pages: int = 1 << 17  # scratch pages reserved (never touched unless a case copies them): past one extent
    max_run_pages: int = 64  # pages of the "runs" case (the extent cases take their pages around each boundary)
    seed: int = 0
    copy_methods: tuple[str, ...] = ("memcpy2d", "torch")  # CUDA paths to try
    cuda: bool = True  # also check CUDA paths when torch sees a GPU
    delay_cycles: int = 500_000_000  # GPU sleep for the ordering checks (~0.25 s at 2 GHz)
    reference_pages: int = 2  # pages per case compared with the slow reference converter
    transfer: TransferConfig | None = None  # None: small groups and staging, to exercise every unit boundary


def mismatched_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    if torch.equal(as_bits(a), as_bits(b)):  # the common case, without a byte-sized temporary
        return 0
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def bytes_not_sentinel(t: torch.Tensor) -> int:
    """Bytes of t that no longer hold the sentinel (t: a region nothing should have written)."""
    return int((t.contiguous().view(torch.uint8) != SENTINEL).sum()) if t.numel() else 0


def random_kv(layout: KVLayout, num_tokens: int, seed: int, device) -> torch.Tensor:
    """kv [L, 2, H, T, D] of random bits (NaN patterns included), generated on ``device``."""
    kv = torch.empty(
        (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim),
        dtype=torch_dtype(layout.dtype),
        device=device,
    )
    bits = as_bits(kv)
    info = torch.iinfo(bits.dtype)
    bits.random_(info.min, info.max, generator=torch.Generator(device=device).manual_seed(seed))  # in place: no 2x peak
    return kv


def sentinel_kv(layout: KVLayout, num_tokens: int, device) -> torch.Tensor:
    kv = torch.empty(
        (layout.num_layers, 2, layout.num_kv_heads, num_tokens, layout.head_dim),
        dtype=torch_dtype(layout.dtype),
        device=device,
    )
    kv.view(torch.uint8).fill_(SENTINEL)
    return kv


def round_trip(transfer, client, cases, config: ByteCheckConfig, device) -> tuple[int, int]:
    """Store then load every case; (bytes checked, bytes wrong)."""
    lay = config.layout
    checked = wrong = 0
    for case_index, (_name, first_chunk, offsets) in enumerate(cases):
        capacity = (first_chunk + len(offsets) + 1) * lay.chunk_tokens
        src = random_kv(lay, capacity, config.seed + case_index, device)
        sums = transfer.store(src, first_chunk, offsets)
        headers = [
            PageHeader(offset=o, page_bytes=lay.page_bytes, checksum=s, checksum_kind=transfer.checksum_kind)
            for o, s in zip(offsets, sums)
        ]
        for header in headers:
            if not is_valid(client.page(header.offset, lay.page_bytes), header):
                wrong += lay.page_bytes  # a checksum of other bytes than those in the page (GPU WSUM32: vs the host's)
        for i in sorted({0, len(offsets) - 1})[: config.reference_pages]:
            t0 = (first_chunk + i) * lay.chunk_tokens
            expected = page_bytes_of(
                reference_engine_to_pages(src[:, :, :, t0 : t0 + lay.chunk_tokens].cpu(), lay, 0, 1)
            )
            stored = client.page(offsets[i], lay.page_bytes)
            wrong += int((stored != np.frombuffer(expected, dtype=np.uint8)).sum())
            checked += lay.page_bytes
        dst = sentinel_kv(lay, capacity, device)
        handle = transfer.load(dst, first_chunk, headers)
        try:
            handle.verify()  # every page checked by its kind (verify_fraction permitting) beside the copies
        except ChunkChecksumMismatch as exc:
            wrong += (first_chunk + len(offsets) - exc.chunk_index) * lay.page_bytes
        t0, t1 = first_chunk * lay.chunk_tokens, (first_chunk + len(offsets)) * lay.chunk_tokens
        wrong += mismatched_bytes(dst[:, :, :, t0:t1], src[:, :, :, t0:t1])
        wrong += bytes_not_sentinel(dst[:, :, :, :t0]) + bytes_not_sentinel(dst[:, :, :, t1:])
        checked += (t1 - t0) * lay.bytes_per_token
    return checked, wrong
