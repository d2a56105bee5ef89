"""A minimal CPU implementation of the KVTransfer contract (docs/dev/contracts.md).

Private stand-in until kvshare.transfer.CpuTransfer lands; the engine calls it
only through the contract (load / store / LoadHandle), so the switch is one import.
"""

from __future__ import annotations

import time

import torch

from kvshare.layout import KVLayout
from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import ChecksumMismatch, PoolClient
from kvshare.pool.protocol import FORMAT_VERSION, PageHeader

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CpuLoadHandle:
    """A finished load: every layer is in place when ``load`` returns."""

    def __init__(self, num_bytes: int, seconds: float) -> None:
        self.num_bytes = num_bytes
        self.seconds = seconds

    def wait_layer(self, layer: int) -> None:
        pass

    def wait_all(self) -> None:
        pass


class CpuTransfer:
    def __init__(self, layout: KVLayout, client: PoolClient, device: torch.device, config=None) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError("CpuTransfer moves KV between the arena and CPU tensors only")
        self.layout = layout
        self.client = client
        self._dtype = _TORCH[layout.dtype]

    def _page(self, offset: int) -> torch.Tensor:
        view = self.client.page(offset, self.layout.page_bytes)  # contiguous uint8, asserted by the client
        return torch.from_numpy(view).view(self._dtype).view(self.layout.page_shape)  # [L, 2, C, H, D]

    def load(self, kv: torch.Tensor, first_chunk: int, pages: list[PageHeader]) -> CpuLoadHandle:
        start = time.perf_counter()
        c = self.layout.chunk_tokens
        for i, header in enumerate(pages):
            if header.page_bytes != self.layout.page_bytes or header.format_version != FORMAT_VERSION:
                raise ChecksumMismatch(f"chunk {first_chunk + i}: page of {header.page_bytes} bytes, format {header.format_version}")
            if self.client.verify_checksums:
                if page_checksum(self.client.page(header.offset, header.page_bytes)) != header.checksum:
                    raise ChecksumMismatch(f"chunk {first_chunk + i} (page at offset {header.offset}) does not match its checksum")
            a = (first_chunk + i) * c
            kv[:, :, :, a : a + c, :].copy_(self._page(header.offset).transpose(2, 3))
        return CpuLoadHandle(len(pages) * self.layout.page_bytes, time.perf_counter() - start)

    def store(self, kv: torch.Tensor, first_chunk: int, offsets: list[int], producer_stream=None) -> list[int]:
        c = self.layout.chunk_tokens
        checksums = []
        for i, offset in enumerate(offsets):
            a = (first_chunk + i) * c
            self._page(offset).copy_(kv[:, :, :, a : a + c, :].transpose(2, 3))
            checksums.append(page_checksum(self.client.page(offset, self.layout.page_bytes)))
        return checksums
