"""Pool pages <-> vLLM's paged KV on a GPU, through staging buffers: one worker's streams, buffers and copies.

    load   load copy stream:  H2D unit 0 -> L0 | H2D unit 1 -> L1 | H2D unit 2 -> L0 (after its scatter) | ...
           load reshape:           scatter L0 -> blocks, WSUM32 | scatter L1 -> blocks, WSUM32 | ...   an event per layer group
    store  vLLM's stream:     ... the kernels that wrote layer l | event (save_kv_layer of a group's last layer)
           store reshape:     (waits for it) gather blocks -> S0, WSUM32 | gather -> S1, WSUM32 | ...
           store copy stream:                D2H S0 -> pages | D2H S1 -> pages | ...              the store's end event

A unit is one layer group x a block of the pages of one load or store (kvshare.transfer.plan). In a
page a group's layers are one contiguous row of >= ``min_copy_bytes``, so each run of pages lying
back to back in the arena inside one extent (= one CUDA registration) moves as ONE
cudaMemcpy2DAsync (kvshare.transfer.copiers) between registered pages and packed staging rows,
every host range checked to lie inside one registration. Pages are always staged whole, so every
page is checksummed whole on the GPU (kvshare.pool.wsum); a load that starts or ends inside a
page scatters only its own tokens. The scatter/gather between staging and vLLM's blocks is one
advanced-indexing kernel per (layer, run of pages with the same token range), at HBM speed.

A tensor parallel rank (``heads``: some of the page's KV heads, kvshare.integrations.vllm.tensor_parallel)
loads whole pages the same way and scatters only its heads' columns of them; a store gathers its heads
into staging packed ``[n, g, 2, C, h, D]`` and writes them with 2-D copies of the slice's width at the
pitch of a page row of every head (kvshare.transfer.plan.head_copies), never touching the other heads'
bytes, summing its part of each page's WSUM32 on the GPU (wsum.add_head_rows). With every head (one
rank) none of this runs: the copies, kernels and sums are the ones above.

Every dependency is an event: a load's scatters wait for vLLM's stream as it was at start_load_kv,
vLLM's attention for its layer group's event, a store's gathers for the event recorded after the
kernels that wrote the layer, each buffer's reuse for its previous user (``idle``).
``order_after_producer`` is the one place a store waits for vLLM; the deliberately broken control of
the validation (kvshare.integrations.vllm.ordercheck) overrides it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from kvshare.integrations.vllm.layout import PagedLayout, as_bits
from kvshare.integrations.vllm.tensor_parallel import HeadSlice
from kvshare.layout import KVLayout
from kvshare.pool.checksum import PageHasher
from kvshare.pool.wsum import add_head_rows, add_rows, as_unsigned
from kvshare.transfer.base import TransferConfig
from kvshare.transfer.copiers import make_copier
from kvshare.transfer.layouts import bits_dtype, chunks_view
from kvshare.transfer.plan import RowCopy, Unit, head_copies, layer_groups, load_units, pages_per_unit
from kvshare.transfer.registration import acquire_registration, release_registration

NUM_BUFFERS = 2  # per direction: one fills while the other drains


@dataclass
class Buffers:
    """Staging buffers used in turn, each with the event of its last use."""

    tensors: list[torch.Tensor]
    idle: list = field(default_factory=list)
    next: int = 0

    def take(self) -> int:
        index = self.next
        self.next = (index + 1) % len(self.tensors)
        return index


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


class StagingEngine:
    """Streams, staging buffers, the 2-D copier and the arena's registration of one worker's GPU.

    ``heads``: the page heads ``layers`` hold (None: all of them, one rank)."""

    def __init__(self, layers: list[torch.Tensor], paged: PagedLayout, kv_layout: KVLayout, config: TransferConfig,
                 heads: HeadSlice | None = None) -> None:
        self.device = layers[0].device
        self.kv_layout, self.paged, self.config = kv_layout, paged, config
        self.heads = heads or HeadSlice(0, 1, 0, kv_layout.num_kv_heads)
        self.is_sliced = self.heads.num_heads != kv_layout.num_kv_heads  # a tensor parallel rank's heads only
        if self.is_sliced and (kv_layout.head_dim * kv_layout.itemsize) % 4:
            raise ValueError(f"a head of {kv_layout.head_dim} x {kv_layout.itemsize} bytes is not a whole number "
                             "of 32-bit words: a rank's part of a page's WSUM32 cannot be summed")
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.copier = make_copier(config.copy_method, index)  # fails (no cuda-bindings) before anything is allocated
        self.groups = layer_groups(kv_layout.num_layers, kv_layout.layer_bytes, config.min_copy_bytes)
        self.group_of_layer = [g for g, (l0, l1) in enumerate(self.groups) for _ in range(l0, l1)]
        widest = max(l1 - l0 for l0, l1 in self.groups) * kv_layout.layer_bytes
        pages_per_unit(config.staging_bytes, widest)  # refuses staging that cannot hold one page's row
        # [2, B, N, H, D'] views of vLLM's layers as the widest integers that tile a head's D elements (the
        # index kernels move a few wide words instead of many 2-byte ones), staged pages viewed alike
        self.word_bytes = word_bytes(layers, paged)
        self.blocks = [widen(paged.kv_blocks(as_bits(layer)), self.word_bytes) for layer in layers]
        with self._on_device():
            # high priority: the scatters get SMs ahead of long compute kernels, so the copies keep flowing
            self.load_copy = torch.cuda.Stream(self.device, priority=-1)
            self.load_reshape = torch.cuda.Stream(self.device, priority=-1)
            self.store_reshape = torch.cuda.Stream(self.device, priority=-1)
            self.store_copy = torch.cuda.Stream(self.device, priority=-1)
            self.load_buffers = self._buffers()
            self.store_buffers = self._buffers()
        self.registration = None
        self._registered_arena = None  # the mapping registered (kept alive while it is)
        self._warmed_up = False
        self.hasher = PageHasher(config.num_checksum_threads)  # checks xxh3 pages (CPU writers') beside the copies

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _buffers(self) -> Buffers:
        tensors = [torch.empty(self.config.staging_bytes, dtype=torch.uint8, device=self.device) for _ in range(NUM_BUFFERS)]
        return Buffers(tensors, [torch.cuda.Event() for _ in range(NUM_BUFFERS)])

    # -- the arena ---------------------------------------------------------------------------------

    def ensure_registered(self, client) -> None:
        """Register the client's arena with CUDA once per mapping (in extent pieces). A failed registration
        raises: never a silent fall back to pageable memory."""
        if self._registered_arena is client.arena:
            return
        self._release_registration()
        self.registration = acquire_registration(client)
        self._registered_arena = client.arena
        if not self._warmed_up:
            self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run every kernel a load or store launches once, on scratch tensors of the same dtypes: CUDA loads
        kernels lazily, and a fresh replica's first store paid ~70 ms for that on the H200 (Qwen3-8B shape,
        32k). Called with the arena's registration (worker.prepare), so it happens at start-up."""
        C, N = self.kv_layout.chunk_tokens, self.paged.block_size
        shape = self.blocks[0].shape  # [2, B, N, H, D'] words
        with self._on_device(), torch.cuda.stream(self.load_reshape):
            blocks = torch.zeros((2, -(-C // N), N, *shape[3:]), dtype=self.blocks[0].dtype, device=self.device)
            staged = torch.zeros((1, 2, C, *shape[3:]), dtype=blocks.dtype, device=self.device)
            slots = self.slots(list(range(blocks.shape[1])), [0], self.load_reshape)
            whole = Segment(0, 1, 0, C)
            scatter_staged(blocks, staged, slots, whole, 0)
            gather_staged(blocks, staged, slots, whole, 0)
            acc = torch.zeros(1, dtype=torch.int64, device=self.device)
            add_rows(acc, staged.view(1, -1).view(torch.int32), 0)
            if self.is_sliced:  # staged holds this rank's heads: its part of a page's sum
                add_head_rows(acc, staged.view(torch.int32).view(1, 2 * C, shape[3], -1), 0, self.heads.first_head,
                              self.kv_layout.num_kv_heads)
            as_unsigned(acc)  # the read back (synchronizes this stream)
        self._warmed_up = True

    def _release_registration(self) -> None:
        if self.registration is not None:
            registration, self.registration, self._registered_arena = self.registration, None, None
            release_registration(registration)

    def units(self, offsets: list[int], client) -> list[list[Unit]]:
        """The units moving whole pages at ``offsets``, per layer group in layer order."""
        cfg = self.config
        return list(load_units(offsets, self.kv_layout, cfg.min_copy_bytes, cfg.staging_bytes, client.hello.extent_bytes))

    def host_copies(self, copies: tuple[RowCopy, ...], buffer: torch.Tensor, stream, client, to_device: bool) -> None:
        """2-D copies between registered pages and ``buffer``, enqueued on ``stream``."""
        for c in copies:  # no copy may span two registrations ("invalid argument" on the H200)
            self.registration.check_span(c.host_offset, (c.height - 1) * c.host_pitch + c.width)
        self.copier.copy(copies, client, self.registration.base_ptr, buffer, stream, to_device)

    def staged(self, buffer: torch.Tensor, unit: Unit) -> torch.Tensor:
        """The unit's pages in ``buffer`` as integers ``[n, g, 2, C, H, D']`` (words of ``word_bytes``)."""
        return widen(chunks_view(buffer, self.kv_layout, unit.num_pages, unit.num_layers), self.word_bytes)

    def own_heads(self, staged: torch.Tensor) -> torch.Tensor:
        """This rank's heads of staged pages ``[..., H, D']``: ``[..., h, D']`` (a view; all heads: ``staged``)."""
        return staged[..., self.heads.heads, :] if self.is_sliced else staged

    # -- stores: whole pages with every head, a rank's heads packed --------------------------------

    def store_copies(self, unit: Unit) -> tuple[RowCopy, ...]:
        """The 2-D copies that write a store unit's staged bytes into its pages (a rank: its heads only)."""
        if not self.is_sliced:
            return unit.copies
        return head_copies(unit, self.kv_layout, self.heads.first_head, self.heads.num_heads)

    def store_staged(self, buffer: torch.Tensor, unit: Unit) -> torch.Tensor:
        """Where a store unit's gathers write in ``buffer``: ``[n, g, 2, C, h, D']`` (h: this rank's heads)."""
        if not self.is_sliced:
            return self.staged(buffer, unit)
        layout, h = self.kv_layout, self.heads.num_heads
        shape = (unit.num_pages, unit.num_layers, 2, layout.chunk_tokens, h, layout.head_dim)
        num_bytes = unit.num_pages * unit.row_bytes * h // layout.num_kv_heads
        return widen(buffer[:num_bytes].view(bits_dtype(layout.itemsize)).view(shape), self.word_bytes)

    def add_store_sums(self, acc: torch.Tensor, buffer: torch.Tensor, unit: Unit) -> None:
        """``acc`` (one int64 per page of the unit) += the WSUM32 terms of the unit's staged bytes: the
        page's whole rows, or, for a rank, its heads' part of them (summed over ranks: the page's)."""
        if not self.is_sliced:
            add_rows(acc, self.rows(buffer, unit), self.word_offset(unit))
            return
        C, rows = self.kv_layout.chunk_tokens, unit.num_layers * 2 * self.kv_layout.chunk_tokens
        words = self.store_staged(buffer, unit).view(torch.int32)  # [n, g, 2, C, h, W]
        add_head_rows(acc, words.view(unit.num_pages, rows, self.heads.num_heads, -1), unit.layer_start * 2 * C,
                      self.heads.first_head, self.kv_layout.num_kv_heads)

    def rows(self, buffer: torch.Tensor, unit: Unit) -> torch.Tensor:
        """The unit's pages in ``buffer`` as 32-bit words ``[n, g * layer_bytes / 4]`` (for WSUM32)."""
        num_bytes = unit.num_pages * unit.row_bytes
        return buffer[:num_bytes].view(torch.int32).view(unit.num_pages, -1)

    def word_offset(self, unit: Unit) -> int:
        """Where the unit's rows start in each page, in 32-bit words."""
        return unit.layer_start * self.kv_layout.layer_bytes // 4

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

    def order_after_producer(self, stream, produced) -> None:
        """A store's first read of vLLM's blocks waits for the kernels that wrote them."""
        stream.wait_event(produced)

    def close(self) -> None:
        for stream in (self.load_copy, self.load_reshape, self.store_reshape, self.store_copy):
            stream.synchronize()
        self.hasher.close()
        self._release_registration()


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
    index = (slot_blocks[segment.first : segment.stop, segment.lo : segment.hi],
             slot_offsets[segment.first : segment.stop, segment.lo : segment.hi])  # [n, T] each
    blocks[:, index[0], index[1]] = staged[a:b, :, segment.lo : segment.hi].transpose(0, 1)  # [2, n, T, H, D]


def gather_staged(blocks: torch.Tensor, staged: torch.Tensor, slots: tuple, segment: Segment, first_page: int) -> None:
    """The inverse of scatter_staged: the tokens' K and V from ``blocks`` into the staged pages."""
    a, b = segment.first - first_page, segment.stop - first_page
    slot_blocks, slot_offsets = slots
    index = (slot_blocks[segment.first : segment.stop, segment.lo : segment.hi],
             slot_offsets[segment.first : segment.stop, segment.lo : segment.hi])
    staged[a:b, :, segment.lo : segment.hi].copy_(blocks[:, index[0], index[1]].transpose(0, 1))
