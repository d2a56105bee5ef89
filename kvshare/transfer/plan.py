"""Which copies move a call's pages: runs of consecutive pages, groups of layers, staged units.

Pure arithmetic, no torch, so the plan a GPU executes is tested on any machine.

A call moves pages 0..n-1 of one request (chunk ``first_chunk + i`` lives in
page i). Pages whose arena offsets follow each other form a *run*; a run never
crosses an allocator extent, because each extent is a separate CUDA
registration and a copy spanning two of them fails::

    page i          0      1      2      3      4
    arena offset    A      A+P    A+2P   B      B+P        (P = page bytes)
    runs            [---- run 0 ------]  [-- run 1 --]

A *unit* is what one staging buffer holds: pages [p0, p1) x layers [l0, l1).
In a page the layers [l0, l1) are one contiguous row of ``W = (l1 - l0) *
layer_bytes`` bytes, so each run inside a unit is ONE 2-D copy (height = its
pages, width = W, host pitch = P) into packed staging rows::

    staging   |page p0: layers l0..l1-1|page p0+1: ...|...|      [p1-p0, l1-l0, 2, C, H, D]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvshare.layout import KVLayout


@dataclass(frozen=True)
class PageRun:
    """``num_pages`` pages of a call, ``first`` .. ``first + num_pages - 1``, consecutive in the arena."""

    first: int
    offset: int
    num_pages: int


@dataclass(frozen=True)
class RowCopy:
    """One 2-D copy between the arena and a staging buffer: ``height`` rows of ``width`` bytes."""

    host_offset: int  # arena offset of the first row
    host_pitch: int  # bytes between rows in the arena (the page size)
    stage_offset: int  # byte offset of the first row in the staging buffer (rows are packed there)
    width: int
    height: int


@dataclass(frozen=True)
class Unit:
    """Pages [page_start, page_stop) x layers [layer_start, layer_stop) of a call, staged together."""

    layer_start: int
    layer_stop: int
    page_start: int
    page_stop: int
    copies: tuple[RowCopy, ...]

    @property
    def num_pages(self) -> int:
        return self.page_stop - self.page_start

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def row_bytes(self) -> int:
        return self.copies[0].width

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.row_bytes


def page_runs(
    offsets: Sequence[int], page_bytes: int, extent_bytes: int | None = None, start: int = 0, stop: int | None = None
) -> list[PageRun]:
    """Maximal runs of pages[start:stop] on consecutive offsets, each inside one extent."""
    stop = len(offsets) if stop is None else stop
    runs: list[PageRun] = []
    first = start  # the open run: pages first..i-1 (one PageRun per run, not per page: a 256k load has 1023)
    for i in range(start + 1, stop + 1):
        if i < stop:
            offset, base = offsets[i], offsets[first]
            follows = offset == base + (i - first) * page_bytes
            if follows and (extent_bytes is None or offset // extent_bytes == base // extent_bytes):
                continue
        runs.append(PageRun(first, offsets[first], i - first))
        first = i
    return runs


def layer_groups(num_layers: int, layer_bytes: int, min_copy_bytes: int) -> list[tuple[int, int]]:
    """[l0, l1) ranges, as many as possible, each a row of >= ``min_copy_bytes`` in a page.

    Sizes differ by at most one layer; a model whose whole page is below the minimum is one group.
    """
    min_layers = min(num_layers, max(1, -(-min_copy_bytes // layer_bytes)))
    num_groups = num_layers // min_layers
    base, extra = divmod(num_layers, num_groups)
    groups, l0 = [], 0
    for g in range(num_groups):
        l1 = l0 + base + (1 if g < extra else 0)
        groups.append((l0, l1))
        l0 = l1
    return groups


def last_layer_alone(groups: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``groups`` with the last layer split off into a group of its own (where the last group holds more).

    A load's reader computes layer l once group(l) has landed; with the last layer alone it computes every
    other layer while that layer's copies still run, and what is left after the load's last copy is one
    layer's compute (the built-in engine's last layer attends for one query) instead of a group's. Its rows
    are narrower than ``min_copy_bytes``, for 1/L of the bytes."""
    l0, l1 = groups[-1]
    if l1 - l0 < 2:
        return list(groups)
    return list(groups[:-1]) + [(l0, l1 - 1), (l1 - 1, l1)]


def pages_per_unit(staging_bytes: int, row_bytes: int) -> int:
    """Pages whose rows of ``row_bytes`` fit one staging buffer."""
    if row_bytes > staging_bytes:
        raise ValueError(
            f"a staging buffer of {staging_bytes} bytes cannot hold one row of {row_bytes} bytes; "
            "raise TransferConfig.staging_bytes or lower min_copy_bytes"
        )
    return staging_bytes // row_bytes


def plan_unit(
    offsets: Sequence[int],
    layout: KVLayout,
    layers: tuple[int, int],
    pages: tuple[int, int],
    extent_bytes: int | None,
    runs: Sequence[PageRun] | None = None,
) -> Unit:
    """The copies that move layers ``layers`` of pages ``pages`` of a call, one per run
    (``runs``: page_runs of those pages, when the caller has them already)."""
    l0, l1 = layers
    p0, p1 = pages
    if not (0 <= l0 < l1 <= layout.num_layers and 0 <= p0 < p1 <= len(offsets)):
        raise ValueError(f"layers {layers} / pages {pages} outside the layout or the call")
    if runs is None:
        runs = page_runs(offsets, layout.page_bytes, extent_bytes, p0, p1)
    width = (l1 - l0) * layout.layer_bytes
    copies = tuple(
        RowCopy(
            host_offset=run.offset + l0 * layout.layer_bytes,
            host_pitch=layout.page_bytes,
            stage_offset=(run.first - p0) * width,
            width=width,
            height=run.num_pages,
        )
        for run in runs
    )
    return Unit(l0, l1, p0, p1, copies)


def head_copies(unit: Unit, layout: KVLayout, first_head: int, num_heads: int) -> tuple[RowCopy, ...]:
    """The copies that move only heads ``first_head .. first_head + num_heads - 1`` of the unit's pages,
    to or from staging that packs just those heads, ``[n, g, 2, C, h, D]``. A page row (layer, K/V,
    token) holds every head; the copy's rows are these, its width the slice::

        page row:   | head 0 | head 1 | head 2 | head 3 |      host pitch = H * D * itemsize
        h = 2 of 4:                   |<---- width ---->|      staging: the slices back to back

    The rows of a layer group do not continue evenly into the next page, so each page of a run is
    one 2-D copy; a unit of every layer keeps one copy per run (its rows do continue)."""
    if not (0 <= first_head and num_heads > 0 and first_head + num_heads <= layout.num_kv_heads):
        raise ValueError(f"heads {first_head}..{first_head + num_heads - 1} outside the layout's {layout.num_kv_heads}")
    head_bytes = layout.head_dim * layout.itemsize
    pitch, width = layout.num_kv_heads * head_bytes, num_heads * head_bytes
    rows_per_page = unit.num_layers * 2 * layout.chunk_tokens
    stage_page = rows_per_page * width  # one page's slice in staging
    copies: list[RowCopy] = []
    for c in unit.copies:
        first_page = c.stage_offset // c.width  # the run's first page, counted in the unit
        host = c.host_offset + first_head * head_bytes
        if unit.num_layers == layout.num_layers:
            copies.append(RowCopy(host, pitch, first_page * stage_page, width, c.height * rows_per_page))
            continue
        copies.extend(
            RowCopy(host + k * c.host_pitch, pitch, (first_page + k) * stage_page, width, rows_per_page)
            for k in range(c.height)
        )
    return tuple(copies)


def page_blocks(num_pages: int, block_pages: int, first_page: int = 0) -> list[tuple[int, int]]:
    """[p0, p1) ranges of at most ``block_pages`` pages covering first_page..num_pages-1."""
    return [(p0, min(p0 + block_pages, num_pages)) for p0 in range(first_page, num_pages, block_pages)]


def load_units(
    offsets: Sequence[int],
    layout: KVLayout,
    min_copy_bytes: int,
    staging_bytes: int,
    extent_bytes: int | None,
    groups: Sequence[tuple[int, int]] | None = None,
    first_page: int = 0,
) -> Iterator[list[Unit]]:
    """Units of a load, per layer group in layer order: early layers land first, so compute can start.
    ``groups``: the caller's layer groups (default ``layer_groups`` of ``min_copy_bytes``); ``first_page``: the
    units cover pages first_page.. only (those before come from elsewhere: copies ahead).

    Lazy (one group at a time), so a load's first copies start before the whole plan is made."""
    runs_of_block: dict[tuple[int, int], list[PageRun]] = {}  # the same page blocks recur in every group
    if groups is None:
        groups = layer_groups(layout.num_layers, layout.layer_bytes, min_copy_bytes)
    for layers in groups:
        block = pages_per_unit(staging_bytes, (layers[1] - layers[0]) * layout.layer_bytes)
        units = []
        for pages in page_blocks(len(offsets), block, first_page):
            if pages not in runs_of_block:
                runs_of_block[pages] = page_runs(offsets, layout.page_bytes, extent_bytes, *pages)
            units.append(plan_unit(offsets, layout, layers, pages, extent_bytes, runs_of_block[pages]))
        yield units


def store_units(
    offsets: Sequence[int], layout: KVLayout, min_copy_bytes: int, staging_bytes: int, extent_bytes: int | None
) -> list[list[Unit]]:
    """Units of a store, per block of pages in page order: whole pages finish early and are hashed
    while later ones still copy."""
    groups = layer_groups(layout.num_layers, layout.layer_bytes, min_copy_bytes)
    widest = max(l1 - l0 for l0, l1 in groups) * layout.layer_bytes
    return [
        [plan_unit(offsets, layout, layers, pages, extent_bytes) for layers in groups]
        for pages in page_blocks(len(offsets), pages_per_unit(staging_bytes, widest))
    ]
