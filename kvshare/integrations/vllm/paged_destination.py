"""vLLM's paged KV on a GPU as the staging pipeline's destination layout (kvshare.transfer.pipeline).

The pipeline (streams, rotating staging buffers, the arena's registration, the 2-D copies, both loops)
is kvshare.transfer's, shared with the built-in engine; this module says only where a unit's staged
pages go in vLLM's blocks and come from::

    load   pipeline: H2D unit -> staging | scatter: staged pages -> vLLM's blocks (PagedDestination.scatter)
    store  pipeline: gather: vLLM's blocks -> staging (PagedDestination.gather) | D2H staging -> pages

Pages are always staged whole, so every page is checksummed whole on the GPU (kvshare.pool.wsum); a
load that starts or ends inside a page scatters only its own tokens (``Segment``). The scatter/gather
between staging and vLLM's blocks is one advanced-indexing kernel per (layer, run of pages with the same
token range), at HBM speed, on integers of the widest width that tiles a head (``word_bytes``).

A tensor parallel rank (``heads``: some of the page's KV heads, kvshare.integrations.vllm.tensor_parallel)
loads whole pages the same way and scatters only its heads' columns of them; a store gathers its heads
into the staging the pipeline packs ``[n, g, 2, C, h, D]`` and the pipeline writes them with 2-D copies
of the slice's width (kvshare.transfer.plan.head_copies), never touching the other heads' bytes, summing
its part of each page's WSUM32 (wsum.add_head_rows). With every head (one rank) none of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.integrations.vllm.layout import PagedLayout, as_bits
from kvshare.integrations.vllm.tensor_parallel import HeadSlice
from kvshare.layout import KVLayout
from kvshare.transfer.plan import Unit


@dataclass(frozen=True)
class Segment:
    """Pages ``first .. stop - 1`` of a load or store whose tokens ``lo .. hi - 1`` move (the same for each)."""

    first: int
    stop: int
    lo: int
    hi: int


def segments_of(ranges: list[tuple[int, int]]) -> list[Segment]:
    """Maximal runs of consecutive pages with the same token range (only a load's first and last page differ)."""
    segments: list[Segment] = []
    for index, (lo, hi) in enumerate(ranges):
        last = segments[-1] if segments else None
        if last is not None and (last.lo, last.hi) == (lo, hi):
            segments[-1] = Segment(last.first, index + 1, lo, hi)
        else:
            segments.append(Segment(index, index + 1, lo, hi))
    return segments


def clip(segment: Segment, first: int, stop: int) -> Segment | None:
    """The part of ``segment`` inside pages ``first .. stop - 1``, or None."""
    a, b = max(segment.first, first), min(segment.stop, stop)
    return Segment(a, b, segment.lo, segment.hi) if a < b else None


class PagedKV:
    """One worker's vLLM KV tensors as the pipeline sees them: ``[2, B, N, h, D']`` integer views per layer.

    ``heads``: the page heads ``layers`` hold (None: all of them, one rank)."""

    def __init__(
        self, layers: list[torch.Tensor], paged: PagedLayout, kv_layout: KVLayout, heads: HeadSlice | None = None
    ) -> None:
        self.device = layers[0].device
        self.kv_layout, self.paged = kv_layout, paged
        self.heads = heads or HeadSlice(0, 1, 0, kv_layout.num_kv_heads)
        self.is_sliced = self.heads.num_heads != kv_layout.num_kv_heads  # a tensor parallel rank's heads only
        # [2, B, N, H, D'] views of vLLM's layers as the widest integers that tile a head's D elements (the
        # index kernels move a few wide words instead of many 2-byte ones), staged pages viewed alike
        self.word_bytes = word_bytes(layers, paged)
        self.blocks = [widen(paged.kv_blocks(as_bits(layer)), self.word_bytes) for layer in layers]

    def own_heads(self, staged: torch.Tensor) -> torch.Tensor:
        """This rank's heads of staged pages ``[..., H, D']``: ``[..., h, D']`` (a view; all heads: ``staged``)."""
        return staged[..., self.heads.heads, :] if self.is_sliced else staged

    def destination(self, slots: tuple, segments: list[Segment] | None = None) -> PagedDestination:
        """The pages of one load (``segments``: which tokens of them move) or store (None: whole pages) whose
        tokens lie at ``slots`` (``slots``)."""
        return PagedDestination(self, self.blocks, slots, segments)

    def scratch(self) -> PagedDestination:
        """A destination over scratch blocks holding one page: the pipeline's warm-up runs its kernels there."""
        C, N = self.kv_layout.chunk_tokens, self.paged.block_size
        shape = self.blocks[0].shape  # [2, B, N, h, D'] words
        blocks = torch.zeros((2, -(-C // N), N, *shape[3:]), dtype=self.blocks[0].dtype, device=self.device)
        table = torch.arange(blocks.shape[1], dtype=torch.long).to(self.device)
        slots = slots_of_table(table, torch.zeros(1, dtype=torch.long).to(self.device), C, N)  # its kernels load here
        if self.device.type == "cuda":  # there before the warm-up's stream reads them
            torch.cuda.current_stream(self.device).synchronize()
        return PagedDestination(self, [blocks], slots, None)

    def slots(self, block_ids, chunks: list[int], stream) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_slots`` of pages holding ``chunks``, computed on the device on ``stream``: only the block
        table and the chunk numbers are uploaded (the [n, C] index arithmetic on the host took ~20 ms per
        128 pages, all of it before the first copy)."""
        table = torch.as_tensor(list(block_ids), dtype=torch.long)
        if table.numel() == 0:
            raise ValueError("the request has no blocks to copy into or out of")
        chunks_t = torch.as_tensor(chunks, dtype=torch.long)
        if self.device.type != "cuda":
            return slots_of_table(table, chunks_t, self.kv_layout.chunk_tokens, self.paged.block_size)
        table, chunks_t = self.upload(table, stream), self.upload(chunks_t, stream)
        with torch.cuda.stream(stream):
            return slots_of_table(table, chunks_t, self.kv_layout.chunk_tokens, self.paged.block_size)

    def upload(self, t: torch.Tensor, stream) -> torch.Tensor:
        """A small host tensor on the device, copied on ``stream`` from pinned memory: the host never
        waits for it (a pageable copy would wait for vLLM's stream)."""
        if self.device.type != "cuda":
            return t
        with torch.cuda.stream(stream):
            return t.pin_memory().to(self.device, non_blocking=True)


class PagedDestination:
    """The pages of one load or store in vLLM's blocks (kvshare.transfer.pipeline.KVDestination)::

    page i of the call, token t   ->   slots[0][i, t] (block), slots[1][i, t] (slot in block)
    """

    def __init__(self, kv: PagedKV, blocks: list[torch.Tensor], slots: tuple, segments: list[Segment] | None) -> None:
        self.kv, self.blocks, self.slots, self.segments = kv, blocks, slots, segments

    def scatter(self, unit: Unit, staged: torch.Tensor) -> None:
        """The unit's staged whole pages ``[n, g, 2, C, H, D]``: this rank's heads of the load's tokens, into blocks."""
        staged = self.kv.own_heads(widen(staged, self.kv.word_bytes))  # [n, g, 2, C, h, D']
        segments = self.segments or [Segment(unit.page_start, unit.page_stop, 0, self.kv.kv_layout.chunk_tokens)]
        pieces = [s for s in (clip(seg, unit.page_start, unit.page_stop) for seg in segments) if s is not None]
        for j in range(unit.num_layers):
            for segment in pieces:
                scatter_staged(self.blocks[unit.layer_start + j], staged[:, j], self.slots, segment, unit.page_start)

    def gather(self, unit: Unit, staged: torch.Tensor) -> None:
        """Whole pages of the unit from the blocks into staging ``[n, g, 2, C, h, D]`` (h: this rank's heads)."""
        staged = widen(staged, self.kv.word_bytes)
        whole = Segment(unit.page_start, unit.page_stop, 0, self.kv.kv_layout.chunk_tokens)
        for j in range(unit.num_layers):
            gather_staged(self.blocks[unit.layer_start + j], staged[:, j], self.slots, whole, unit.page_start)


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def widen(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` (an integer view) with its last axis as integers of ``width`` bytes: the same memory."""
    return t if t.element_size() == width else t.view(_WORDS[width])


def word_bytes(layers: list[torch.Tensor], paged: PagedLayout) -> int:
    """The widest integer (8, 4, 2 or 1 bytes) that tiles a head's ``D`` elements in every layer's view."""
    itemsize = layers[0].element_size()
    for width in (8, 4, 2, 1):
        if width < itemsize or (paged.head_dim * itemsize) % width:
            continue
        try:
            for layer in layers:
                widen(paged.kv_blocks(as_bits(layer)), width)
        except RuntimeError:  # a stride or an offset that is not a multiple of the width
            continue
        return width
    return itemsize


def token_slots(block_ids, chunks: list[int], chunk_tokens: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(vLLM block, slot in block) of every token of pages holding ``chunks``, each ``[n, C]`` (host)::

        page of chunk c, token t   ->   prompt position c * C + t   ->   (block_ids[pos // N], pos % N)

    Tokens past the request's block table (the tail of a last, partial page) point at its last
    block; they are never scattered or gathered (segments say which tokens move)."""
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    if table.numel() == 0:
        raise ValueError("the request has no blocks to copy into or out of")
    return slots_of_table(table, torch.as_tensor(chunks, dtype=torch.long), chunk_tokens, block_size)


def slots_of_table(table: torch.Tensor, chunks: torch.Tensor, chunk_tokens: int, block_size: int) -> tuple:
    """``token_slots`` from the block table and chunk numbers as tensors, on their device."""
    positions = chunks[:, None] * chunk_tokens + torch.arange(chunk_tokens, device=chunks.device)[None, :]
    return table[torch.clamp(positions // block_size, max=table.numel() - 1)], positions % block_size


def scatter_staged(blocks: torch.Tensor, staged: torch.Tensor, slots: tuple, segment: Segment, first_page: int) -> None:
    """Tokens ``segment.lo .. hi - 1`` of staged pages (``staged`` ``[n, 2, C, H, D]``: one layer of a unit
    whose first page is ``first_page``) into ``blocks`` ``[2, B, N, H, D]`` at their slots."""
    a, b = segment.first - first_page, segment.stop - first_page
    slot_blocks, slot_offsets = slots
    index = (
        slot_blocks[segment.first : segment.stop, segment.lo : segment.hi],
        slot_offsets[segment.first : segment.stop, segment.lo : segment.hi],
    )  # [n, T] each
    blocks[:, index[0], index[1]] = staged[a:b, :, segment.lo : segment.hi].transpose(0, 1)  # [2, n, T, H, D]


def gather_staged(blocks: torch.Tensor, staged: torch.Tensor, slots: tuple, segment: Segment, first_page: int) -> None:
    """The inverse of scatter_staged: the tokens' K and V from ``blocks`` into the staged pages."""
    a, b = segment.first - first_page, segment.stop - first_page
    slot_blocks, slot_offsets = slots
    index = (
        slot_blocks[segment.first : segment.stop, segment.lo : segment.hi],
        slot_offsets[segment.first : segment.stop, segment.lo : segment.hi],
    )
    staged[a:b, :, segment.lo : segment.hi].copy_(blocks[:, index[0], index[1]].transpose(0, 1))
