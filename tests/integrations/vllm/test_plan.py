"""The vLLM connector's chunk, page-slice and block arithmetic and its lease book (pure; no vLLM needed)."""

import random

import pytest

from kvshare.integrations.vllm.block_copy import BlockCopy, block_copies
from kvshare.integrations.vllm.leases import HeldLease, LeaseBook, LeaseState
from kvshare.integrations.vllm.page_slices import blocks_of_tokens, copy_runs, page_slices
from kvshare.integrations.vllm.prompt_chunks import (
    LookupWindow,
    chunks_completed,
    load_limit,
    lookup_window,
    may_skip_layer_hooks,
    tokens_to_load,
)

C = 256


def test_lookup_window_starts_at_the_chunk_holding_the_first_uncomputed_token():
    assert lookup_window(1000, 0, C) == LookupWindow(0, 3)
    assert lookup_window(1000, 288, C) == LookupWindow(1, 3)  # block aligned, not chunk aligned
    assert lookup_window(1000, 512, C) == LookupWindow(2, 3)
    assert lookup_window(1000, 768, C).num_chunks == 0  # only the tail is left
    assert lookup_window(200, 0, C).num_chunks == 0  # no full chunk at all
    assert lookup_window(512, 511, C).num_chunks == 0  # everything but the last token is computed
    assert lookup_window(512, 480, C, block_size=32).num_chunks == 0  # all but the last block
    assert lookup_window(512, 0, C) == LookupWindow(0, 2)


def test_tokens_to_load_with_unaligned_local_hit():
    # local hit 288 tokens (9 blocks of 32); the pool holds chunks 1 and 2 -> load 288..768
    assert tokens_to_load(1000, 288, C, first_chunk=1, num_hit_chunks=2) == 768 - 288
    # a shorter pool hit than the local one brings nothing
    assert tokens_to_load(1000, 288, C, first_chunk=1, num_hit_chunks=0) == 0
    assert tokens_to_load(1000, 600, C, first_chunk=2, num_hit_chunks=1) == 168


def test_tokens_to_load_always_leaves_one_prompt_token_in_whole_blocks():
    # prompt of exactly two chunks, both in the pool: load all but the last block
    assert tokens_to_load(512, 0, C, 0, 2, block_size=32) == 480
    assert tokens_to_load(512, 480, C, 1, 1, block_size=32) == 0
    assert tokens_to_load(513, 0, C, 0, 2, block_size=32) == 512
    assert tokens_to_load(512, 0, C, 0, 2) == 511  # block size 1: all but the last token
    for block in (1, 16, 32, 256):
        for num_prompt in range(1, 3 * C + 2):
            for computed in range(0, num_prompt, block):
                window = lookup_window(num_prompt, computed, C, block)
                n = tokens_to_load(num_prompt, computed, C, window.first_chunk, window.num_chunks, block)
                if n:
                    assert computed + n <= num_prompt - 1  # at least one token left to compute
                    assert computed + n <= window.end_chunk * C  # only full chunks come from the pool
                    assert (computed + n) % block == 0  # vLLM takes external hits in whole blocks
                else:  # with every chunk in the pool, only nothing-left-to-load gives 0
                    assert min(window.end_chunk * C, load_limit(num_prompt, block)) <= computed


def test_tokens_to_load_refuses_a_gap():
    with pytest.raises(ValueError, match="gap"):
        tokens_to_load(1000, 200, C, first_chunk=1, num_hit_chunks=1)


def test_chunks_completed_over_chunked_prefill_steps():
    assert list(chunks_completed(0, 1000, 1000, C)) == [0, 1, 2]
    # the same prompt over three steps of 300 / 300 / 400 tokens
    assert list(chunks_completed(0, 300, 1000, C)) == [0]
    assert list(chunks_completed(300, 600, 1000, C)) == [1]
    assert list(chunks_completed(600, 1000, 1000, C)) == [2]
    # each chunk is completed in exactly one step, whatever the step sizes
    for step in (1, 7, 32, 100, 255, 256, 257, 1000):
        seen = []
        for before in range(0, 1000, step):
            seen += list(chunks_completed(before, min(before + step, 1000), 1000, C))
        assert seen == [0, 1, 2]
    assert list(chunks_completed(768, 1000, 1000, C)) == []  # the tail is never a chunk
    assert list(chunks_completed(1000, 1001, 1000, C)) == []  # decode steps complete nothing
    assert list(chunks_completed(288, 768, 1000, C)) == [1, 2]  # after an unaligned local hit


def test_page_slices_cover_exactly_the_load():
    slices = page_slices(288, 999, first_chunk=1, num_pages=3, chunk_tokens=C)
    assert [(s.page_index, s.chunk, s.lo, s.hi) for s in slices] == [(0, 1, 32, 256), (1, 2, 0, 256), (2, 3, 0, 231)]
    assert sum(s.num_tokens for s in slices) == 999 - 288
    assert page_slices(10, 10, 0, 1, C) == []
    with pytest.raises(ValueError):
        page_slices(0, 300, first_chunk=1, num_pages=1, chunk_tokens=C)


def test_blocks_of_tokens():
    table = [7, 3, 9, 4]
    assert blocks_of_tokens(32, 96, 32, table) == [3, 9]
    assert blocks_of_tokens(40, 41, 32, table) == [3]
    assert blocks_of_tokens(50, 50, 32, table) == []
    with pytest.raises(ValueError):
        blocks_of_tokens(0, 200, 32, table)


def _lease(lease_id, first_chunk=0, taken_at=0.0):
    return HeldLease(lease_id, first_chunk, pages=[object()], keys=[b"k" * 16], taken_at=taken_at)


def test_lease_book_reuses_a_lease_per_request_id():
    book = LeaseBook(ttl_s=10)
    assert book.put("r1", _lease(1, first_chunk=2, taken_at=0)) is None
    assert book.reusable("r1", 2, now=5).lease_id == 1  # asked again: same lease
    assert book.reusable("r1", 3, now=5) is None  # the local hit grew past it: look up again
    assert book.reusable("r1", 2, now=10) is None  # too old to trust
    assert book.reusable("r2", 2, now=5) is None
    replaced = book.put("r1", _lease(2, first_chunk=3, taken_at=6))
    assert replaced.lease_id == 1  # the caller releases the replaced lease
    assert len(book) == 1


def test_lease_book_expires_pending_leases_but_not_loads_in_flight():
    book = LeaseBook(ttl_s=10)
    book.put("waiting", _lease(1, taken_at=0))
    book.put("loading", _lease(2, taken_at=0))
    book.mark("loading", LeaseState.IN_FLIGHT)
    assert book.take_expired(now=5) == []
    expired = book.take_expired(now=50)
    assert [h.lease_id for h in expired] == [1]
    assert "loading" in book and "waiting" not in book
    assert book.reusable("loading", 0, now=1) is None  # a lease in flight is never handed out again
    with pytest.raises(ValueError, match="in flight"):
        book.put("loading", _lease(3))
    assert [h.lease_id for h in book.take_expired(now=100)] == [2]  # its report never came: give it up
    assert len(book) == 0


def test_copy_runs_merge_adjacent_whole_pages_within_an_extent():
    P = 100
    slices = page_slices(32, 5 * C - 10, first_chunk=0, num_pages=5, chunk_tokens=C)
    offsets = [0, 100, 200, 300, 500]
    runs = copy_runs(slices, offsets, P, C)
    # the partial first page alone, pages 1-3 back to back, page 4 elsewhere (and partial)
    assert [(r.first, r.num_pages, r.lo, r.hi) for r in runs] == [(0, 1, 32, C), (1, 3, 0, C), (4, 1, 0, C - 10)]
    runs = copy_runs(slices, offsets, P, C, extent_bytes=200)  # extents [0, 200), [200, 400), ...
    assert [(r.first, r.num_pages) for r in runs] == [(0, 1), (1, 1), (2, 2), (4, 1)]
    whole = page_slices(0, 4 * C, 0, 4, C)
    assert [(r.first, r.num_pages) for r in copy_runs(whole, [0, 100, 200, 300], P, C, extent_bytes=200)] == [
        (0, 2),
        (2, 2),
    ]


def expand(copies: list[BlockCopy], blocks_per_page: int) -> list[int]:
    """The vLLM block of each of the run's blocks (page-major), as the copies move them; each exactly once."""
    target: dict[int, int] = {}
    for c in copies:
        k = 0
        for page in range(c.first_page, c.first_page + c.num_pages):
            for block in range(c.lo, c.hi):
                assert page * blocks_per_page + block not in target
                target[page * blocks_per_page + block] = c.first_block + c.step * k
                k += 1
    return [target[q] for q in range(len(target))]


def test_block_copies_keep_runs_of_pages_together():
    ids = [10, 11, 12, 13, 14, 15, 16, 17, 9, 8, 7, 6, 2, 5, 3, 4]
    copies = block_copies(4, 4, ids)
    assert copies == [
        BlockCopy(0, 2, 0, 4, 10, 1),  # two whole pages, ascending
        BlockCopy(2, 1, 0, 4, 9, -1),  # a whole page, descending (vLLM frees blocks in reverse)
        BlockCopy(3, 1, 0, 1, 2, 1),
        BlockCopy(3, 1, 1, 2, 5, 1),
        BlockCopy(3, 1, 2, 4, 3, 1),
    ]
    assert expand(copies, 4) == ids
    assert block_copies(64, 8, list(range(100, 612))) == [BlockCopy(0, 64, 0, 8, 100, 1)]  # a fresh server
    assert block_copies(64, 8, list(range(611, 99, -1))) == [BlockCopy(0, 64, 0, 8, 611, -1)]  # a reused one
    # a run that starts and ends inside pages: head, whole pages, tail
    assert block_copies(3, 4, [0, 1, 50, 51, 52, 53, 54, 55, 56, 57, 2, 3]) == [
        BlockCopy(0, 1, 0, 2, 0, 1),
        BlockCopy(0, 1, 2, 4, 50, 1),
        BlockCopy(1, 1, 0, 4, 52, 1),
        BlockCopy(2, 1, 0, 2, 56, 1),
        BlockCopy(2, 1, 2, 4, 2, 1),
    ]
    with pytest.raises(ValueError, match="block ids for"):
        block_copies(2, 4, [1, 2, 3])


@pytest.mark.parametrize("seed", range(20))
def test_block_copies_cover_any_block_table(seed):
    rng = random.Random(seed)
    num_pages, blocks_per_page = rng.randint(1, 6), rng.choice([1, 2, 4, 8])
    ids = []
    while len(ids) < num_pages * blocks_per_page:  # runs up and down of random lengths, as a busy server has
        start, length, step = rng.randrange(1000), rng.randint(1, 12), rng.choice([1, -1])
        ids += [start + step * k for k in range(length)]
    ids = ids[: num_pages * blocks_per_page]
    copies = block_copies(num_pages, blocks_per_page, ids)
    assert expand(copies, blocks_per_page) == ids
    assert all(c.step in (1, -1) and c.num_blocks > 0 for c in copies)


@pytest.mark.parametrize(
    "scheduled, decode_tokens, skips",
    [
        ({"loaded-to-its-last-token": 1, "decoding": 1}, 1, True),  # a uniform decode batch: one full CUDA graph
        ({"loaded": 1}, 1, True),
        ({"loaded": 1, "prefilling": 257}, 1, False),  # mixed: piecewise, attention's hooks run
        ({"loaded": 2}, 1, False),
        ({"loaded": 3, "decoding": 3}, 3, True),  # two speculative tokens a decode step
        ({"loaded": 4}, 3, False),
    ],
)
def test_a_step_of_decode_sized_requests_may_skip_the_layer_hooks(scheduled, decode_tokens, skips):
    assert may_skip_layer_hooks(scheduled, decode_tokens) is skips
