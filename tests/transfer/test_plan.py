"""The copy plan that CudaTransfer executes, checked (and executed with numpy) on CPU.

The emulation below performs each RowCopy as the 2-D copy it stands for and
the staging<->engine reshapes with the same functions the GPU path uses, so a
mistake in the plan or the staging layout shows up here, without a GPU.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvshare.layout import KVLayout
from kvshare.transfer.layouts import as_bits, chunks_to_engine, chunks_view, engine_to_chunks, torch_dtype
from kvshare.transfer.plan import last_layer_alone, layer_groups, load_units, page_runs, pages_per_unit, store_units
from kvshare.transfer.reference import page_bytes_of, reference_engine_to_pages
from tests.transfer.helpers import bits_equal, random_kv

LAYOUT = KVLayout(
    num_layers=5, num_kv_heads=2, head_dim=8, dtype="bfloat16", chunk_tokens=4
)  # layer row 256 B, page 1280 B
EXTENT = 8 * LAYOUT.page_bytes  # consecutive pages cross extents every 8 pages


def test_runs_split_at_gaps_and_extent_boundaries():
    p = 100
    offsets = [0, 100, 200, 500, 600, 700, 800, 300]
    assert [(r.first, r.offset, r.num_pages) for r in page_runs(offsets, p)] == [(0, 0, 3), (3, 500, 4), (7, 300, 1)]
    assert [(r.first, r.num_pages) for r in page_runs(offsets, p, extent_bytes=650)] == [(0, 3), (3, 2), (5, 2), (7, 1)]
    assert [(r.first, r.num_pages) for r in page_runs(offsets, p, start=1, stop=5)] == [(1, 2), (3, 2)]


def _runs_page_by_page(offsets, page_bytes, extent_bytes, start, stop):
    """The definition, one page at a time: a page joins the run before it when it follows it in the same extent."""
    runs = []
    for i in range(start, stop):
        if (
            runs
            and offsets[i] == runs[-1][1] + runs[-1][2] * page_bytes
            and (extent_bytes is None or offsets[i] // extent_bytes == runs[-1][1] // extent_bytes)
        ):
            runs[-1][2] += 1
        else:
            runs.append([i, offsets[i], 1])
    return [tuple(r) for r in runs]


@pytest.mark.parametrize("seed", range(20))
def test_runs_equal_the_page_by_page_definition(seed):
    import random

    rng, p = random.Random(seed), 100
    offsets, at = [], 0
    for _ in range(rng.randrange(0, 60)):
        at = rng.choice([at + p, at + p, at + p, rng.randrange(0, 50) * p])  # mostly consecutive, some jumps
        offsets.append(at)
    extent = rng.choice([None, 250, 400, 10_000])
    start = rng.randrange(0, len(offsets) + 1)
    stop = rng.randrange(start, len(offsets) + 1)
    got = [(r.first, r.offset, r.num_pages) for r in page_runs(offsets, p, extent, start, stop)]
    assert got == _runs_page_by_page(offsets, p, extent, start, stop)


def test_layer_groups_reach_the_minimum_copy():
    assert layer_groups(36, 1 << 20, 2 << 20) == [(i, i + 2) for i in range(0, 36, 2)]  # Qwen3-8B: 1 MiB per layer
    assert layer_groups(5, 256, 600) == [(0, 5)]  # 3 layers reach 600 B; two groups of 3 do not fit 5
    assert layer_groups(7, 256, 400) == [(0, 3), (3, 5), (5, 7)]
    assert layer_groups(5, 256, 1 << 20) == [(0, 5)]  # the whole page is below the minimum: one group
    assert layer_groups(4, 4 << 20, 2 << 20) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="staging"):
        pages_per_unit(1 << 20, 2 << 20)


def test_a_loads_last_layer_goes_alone():
    groups = last_layer_alone(layer_groups(36, 1 << 20, 2 << 20))  # Qwen3-8B's load in CudaTransfer
    assert groups[:17] == [(i, i + 2) for i in range(0, 34, 2)] and groups[17:] == [(34, 35), (35, 36)]
    assert last_layer_alone([(0, 5)]) == [(0, 4), (4, 5)]
    assert last_layer_alone([(0, 1), (1, 2)]) == [(0, 1), (1, 2)]  # already alone
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, chunk_tokens=4, dtype="float16")
    units = list(
        load_units(
            [0, layout.page_bytes], layout, 3 * layout.layer_bytes, 1 << 20, None, groups=last_layer_alone([(0, 4)])
        )
    )
    assert [(u.layer_start, u.layer_stop) for group in units for u in group] == [(0, 3), (3, 4)]


def offset_patterns(num_pages: int) -> dict[str, list[int]]:
    p = LAYOUT.page_bytes
    every = [i * p for i in range(40)]
    shuffled = every[:num_pages]
    random.Random(3).shuffle(shuffled)
    mixed = (
        every[5:12] + every[20:23] + [every[30]] + every[13:18]
    )  # runs across extents (8 pages each), a gap, a single
    return {"runs": every[3 : 3 + num_pages], "shuffled": shuffled, "mixed": mixed[:num_pages]}


def check_plan_shape(schedule, offsets, min_copy, staging):
    covered = {}
    for unit in (u for units in schedule for u in units):
        for page in range(unit.page_start, unit.page_stop):
            for layer in range(unit.layer_start, unit.layer_stop):
                covered[(page, layer)] = covered.get((page, layer), 0) + 1
        assert unit.num_bytes <= staging
        assert sum(c.height for c in unit.copies) == unit.num_pages
        for copy in unit.copies:
            assert copy.width == unit.row_bytes and copy.host_pitch == LAYOUT.page_bytes
            first, last = copy.host_offset, copy.host_offset + (copy.height - 1) * copy.host_pitch + copy.width - 1
            assert first // EXTENT == last // EXTENT, "a copy spans two registrations"
            assert copy.width >= min(min_copy, LAYOUT.page_bytes)
    assert covered == {(p, l): 1 for p in range(len(offsets)) for l in range(LAYOUT.num_layers)}


def emulate_row_copy(copy, arena: np.ndarray, stage: np.ndarray, to_device: bool) -> None:
    """What one cudaMemcpy2DAsync does: ``height`` rows of ``width`` bytes, host pitch -> packed rows."""
    for r in range(copy.height):
        host = slice(copy.host_offset + r * copy.host_pitch, copy.host_offset + r * copy.host_pitch + copy.width)
        dev = slice(copy.stage_offset + r * copy.width, copy.stage_offset + (r + 1) * copy.width)
        if to_device:
            stage[dev] = arena[host]
        else:
            arena[host] = stage[dev]


@pytest.mark.parametrize("pattern", ["runs", "shuffled", "mixed"])
@pytest.mark.parametrize("min_copy,staging", [(1, 3 * 256), (400, 5 * 768), (1 << 20, 1 << 20)])
def test_staged_plan_moves_canonical_bytes(pattern, min_copy, staging):
    num_pages, first_chunk = 16, 2
    offsets = offset_patterns(num_pages)[pattern]
    arena = np.zeros(40 * LAYOUT.page_bytes, dtype=np.uint8)
    stage = np.zeros(staging, dtype=np.uint8)
    stage_t = torch.from_numpy(stage)
    capacity = (first_chunk + num_pages) * LAYOUT.chunk_tokens
    src = random_kv(LAYOUT, capacity, seed=5)

    stores = store_units(offsets, LAYOUT, min_copy, staging, EXTENT)
    check_plan_shape(stores, offsets, min_copy, staging)
    for units in stores:
        for unit in units:
            chunks = chunks_view(stage_t, LAYOUT, unit.num_pages, unit.num_layers)
            engine_to_chunks(
                chunks,
                as_bits(src)[unit.layer_start : unit.layer_stop],
                (first_chunk + unit.page_start) * LAYOUT.chunk_tokens,
            )
            for copy in unit.copies:
                emulate_row_copy(copy, arena, stage, to_device=False)
    for i, offset in enumerate(offsets):
        expected = page_bytes_of(reference_engine_to_pages(src, LAYOUT, first_chunk + i, 1))
        assert arena[offset : offset + LAYOUT.page_bytes].tobytes() == expected

    loads = list(load_units(offsets, LAYOUT, min_copy, staging, EXTENT))
    check_plan_shape(loads, offsets, min_copy, staging)
    assert [units[0].layer_start for units in loads] == sorted(units[0].layer_start for units in loads)
    dst = torch.zeros((LAYOUT.num_layers, 2, 2, capacity, 8), dtype=torch_dtype(LAYOUT.dtype))
    for units in loads:
        for unit in units:
            for copy in unit.copies:
                emulate_row_copy(copy, arena, stage, to_device=True)
            chunks = chunks_view(stage_t, LAYOUT, unit.num_pages, unit.num_layers)
            chunks_to_engine(
                as_bits(dst)[unit.layer_start : unit.layer_stop],
                chunks,
                (first_chunk + unit.page_start) * LAYOUT.chunk_tokens,
            )
    t0 = first_chunk * LAYOUT.chunk_tokens
    assert bits_equal(dst[:, :, :, t0:], src[:, :, :, t0:])
    assert not as_bits(dst)[:, :, :, :t0].any()
