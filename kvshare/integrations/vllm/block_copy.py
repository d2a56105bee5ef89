"""Whole-block copies between pool pages and vLLM's CPU KV, spread over a few threads.

vLLM's CPU worker binds its OpenMP threads to cores. A torch copy there is split over
that team and every copy waits for the team's slowest thread: on a machine whose cores
other processes share, a copy measured 15 ms alone took 40-150 ms. numpy copies run on
the thread that calls them and release the GIL, so a load's copies, one per (layer, run
of blocks), are dealt out to ``num_threads`` threads: the caller and ``num_threads - 1``
helpers. numpy also takes the negative strides that descending block ids need (vLLM
frees a request's blocks in reverse, so a long-running server hands them out that way).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from kvshare.integrations.vllm.layout import PagedLayout, blocks_array, read_blocks, split_axis, write_blocks
from kvshare.integrations.vllm.page_slices import CopyRun

log = logging.getLogger("kvshare.integrations")
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class BlockCopy:
    """One rectangular piece of a copy run that whole-block copies move.

    Blocks ``lo .. hi - 1`` of each of the run's pages ``first_page .. first_page + num_pages - 1``
    (block 0 of a page starts at the run's first token in that page) go, page by page, to
    vLLM blocks ``first_block, first_block + step, ...`` (``step`` is +1 or -1).
    """

    first_page: int
    num_pages: int
    lo: int
    hi: int
    first_block: int
    step: int

    @property
    def num_blocks(self) -> int:
        return self.num_pages * (self.hi - self.lo)


def block_copies(num_pages: int, blocks_per_page: int, block_ids) -> list[BlockCopy]:
    """Cut a run's blocks into rectangles whose vLLM block ids step by +1 or -1.

    ``block_ids`` names the vLLM block of each of the run's ``num_pages * blocks_per_page``
    blocks, page by page. vLLM hands out fresh blocks in ascending order and frees a
    request's blocks in reverse, so a long-running server gives descending runs too::

        pages of 4 blocks   ids 10 11 12 13 | 14 15 16 17 | 9 8 7 6 | 2 5 3 4
        copies              (first_page 0, 2 pages, blocks 0..3, from 10, +1)
                            (first_page 2, 1 page,  blocks 0..3, from 9, -1)
                            (first_page 3, 1 page,  block 0, from 2) (block 1, from 5) (blocks 2..3, from 3, +1)
    """
    if len(block_ids) != num_pages * blocks_per_page:
        raise ValueError(f"{len(block_ids)} block ids for {num_pages} pages of {blocks_per_page} blocks")
    copies: list[BlockCopy] = []
    for start, length, step in _id_runs(block_ids):
        q, end = start, start + length
        while q < end:  # split the run where it leaves a page, keeping whole pages together
            page, lo = divmod(q, blocks_per_page)
            first_block = block_ids[start] + step * (q - start)
            if lo == 0 and end - q >= blocks_per_page:
                num_pages_here = (end - q) // blocks_per_page
                copies.append(BlockCopy(page, num_pages_here, 0, blocks_per_page, first_block, step))
                q += num_pages_here * blocks_per_page
            else:
                hi = min(blocks_per_page, lo + end - q)
                copies.append(BlockCopy(page, 1, lo, hi, first_block, step))
                q += hi - lo
    return copies


def _id_runs(ids) -> list[tuple[int, int, int]]:
    """Maximal runs of ``ids`` that step by +1 or by -1, as (start index, length, step); greedy from the left."""
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(ids):
        step = ids[i + 1] - ids[i] if i + 1 < len(ids) and abs(ids[i + 1] - ids[i]) == 1 else 1
        j = i + 1
        while j < len(ids) and ids[j] - ids[j - 1] == step:
            j += 1
        runs.append((i, j - i, step))
        i = j
    return runs


@dataclass
class BlockRun:
    """A run of adjacent pool pages ([n, L, 2, C, H, D], a view of the arena) and the vLLM blocks of its tokens."""

    run: CopyRun
    pages: np.ndarray
    block_ids: list[int]


class CpuBlockCopier:
    """Copies runs of canonical pages ``[n, L, 2, C, H, D]`` to and from one worker's CPU KV tensors.

    ``heads``: the pages' KV heads this worker's tensors hold (a tensor parallel rank's slice; all by default)."""

    def __init__(
        self, layers: list[torch.Tensor], paged: PagedLayout, num_threads: int = 1, heads: slice = slice(None)
    ) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.blocks = [blocks_array(layer, paged) for layer in layers]  # [2, B, N, H, D] each, vLLM's memory
        self.block_size = paged.block_size
        self.num_threads = num_threads
        self.heads = heads
        self._helpers: ThreadPoolExecutor | None = None  # started on first use

    @property
    def dtype(self) -> np.dtype:
        """The integer type the pages must be viewed as (same width as the KV dtype)."""
        return self.blocks[0].dtype

    def to_blocks(self, pages: np.ndarray, lo: int, hi: int, block_ids) -> None:
        """Tokens ``lo .. hi - 1`` of every page of the run into vLLM blocks ``block_ids`` (page by page)."""
        self._run(pages, lo, hi, block_ids, into_blocks=True)

    def from_blocks(self, pages: np.ndarray, lo: int, hi: int, block_ids) -> None:
        """The inverse: vLLM blocks ``block_ids`` into tokens ``lo .. hi - 1`` of every page of the run."""
        self._run(pages, lo, hi, block_ids, into_blocks=False)

    def layer_to_blocks(self, pages: np.ndarray, lo: int, hi: int, block_ids, index: int) -> None:
        """``to_blocks`` for layer ``index`` only, on the calling thread (a load copied layer by layer)."""
        for blocks, part, first_block, step in self._tasks(pages, lo, hi, block_ids, [index]):
            write_blocks(blocks, part, first_block, step)

    def _run(self, pages: np.ndarray, lo: int, hi: int, block_ids, into_blocks: bool) -> None:
        self._execute(self._tasks(pages, lo, hi, block_ids, range(len(self.blocks))), into_blocks)

    def _tasks(self, pages: np.ndarray, lo: int, hi: int, block_ids, layers) -> list:
        """(layer's blocks, page part [2, P, b, N, H, D], first block, step) per layer and block rectangle."""
        N = self.block_size
        if lo % N or hi % N:
            raise ValueError(f"tokens {lo}..{hi - 1} of a page are not whole blocks of {N}")
        tasks = []
        copies = block_copies(pages.shape[0], (hi - lo) // N, list(block_ids))
        for index in layers:
            layer_pages = pages[:, index, :, lo:hi, self.heads]  # [n, 2, T, h, D]: this worker's heads
            for c in copies:
                part = layer_pages[c.first_page : c.first_page + c.num_pages, :, c.lo * N : c.hi * N]
                part = split_axis(part, 2, N).transpose(1, 0, 2, 3, 4, 5)  # [2, P, b, N, H, D], a view
                tasks.append((self.blocks[index], part, c.first_block, c.step))
        return tasks

    def map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """``[fn(item) for item in items]``, the items dealt out to the copy threads (for page checksums:
        xxhash releases the GIL on large buffers)."""
        results: list = [None] * len(items)

        def work(share: list[int]) -> None:
            for i in share:
                results[i] = fn(items[i])

        self._spread(work, list(range(len(items))))
        return results

    def _execute(self, tasks: list, into_blocks: bool) -> None:
        def work(share) -> None:
            for blocks, part, first_block, step in share:
                if into_blocks:
                    write_blocks(blocks, part, first_block, step)
                else:
                    read_blocks(blocks, first_block, step, part)

        self._spread(work, tasks)

    def _spread(self, work: Callable[[list], None], tasks: list) -> None:
        """``work`` on ``num_threads`` interleaved shares of ``tasks``: the caller's share on the caller."""
        shares = [tasks[k :: self.num_threads] for k in range(self.num_threads)]
        futures = [self._pool().submit(work, share) for share in shares[1:] if share]
        try:
            work(shares[0])
        finally:
            # every helper has finished before this returns or raises: a failed load is recomputed
            # by vLLM, and no helper may still be writing into those blocks then
            wait(futures)
        for future in futures:
            future.result()  # raises a helper's exception

    def _pool(self) -> ThreadPoolExecutor:
        if self._helpers is None:
            self._helpers = ThreadPoolExecutor(
                self.num_threads - 1, thread_name_prefix="kvshare-copy", initializer=leave_the_callers_cores
            )
        return self._helpers

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
            self._helpers = None


def leave_the_callers_cores() -> None:
    """Runs once in each helper thread, which inherited the affinity of the thread that started it: in
    vLLM's CPU worker the single core of OpenMP thread 0, where it could not run beside its caller.
    Move it to the machine's other cores (to all of them where there are no others); the kernel keeps
    it inside the process's cpuset."""
    if not hasattr(os, "sched_setaffinity"):
        return
    inherited = os.sched_getaffinity(0)
    every = set(range(os.cpu_count() or 1))
    try:
        os.sched_setaffinity(0, (every - inherited) or every)
    except OSError as exc:
        log.warning(
            "kvshare: a copy thread stays on cores %s (%s): copies will not run in parallel", sorted(inherited), exc
        )
