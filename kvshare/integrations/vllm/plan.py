"""Scheduler-side arithmetic and lease bookkeeping of the vLLM connector, as pure functions.

No vLLM, no torch, no sockets: everything here is a function of its inputs (clocks
are passed in), so the rules are unit-tested without a server.

A prompt, its chunks (C tokens each) and what the connector loads::

    prompt    |---- chunk 0 ----|---- chunk 1 ----|---- chunk 2 ----|- tail -|
    local     |=========== vLLM's own prefix cache ====|                         num_computed (block aligned,
    lookup                      |-- keys[first_chunk:num_full_chunks] ---------|  not chunk aligned)
    pool hit                    |== leased pages ==================|
    load                                           |= load ========|             start = num_computed,
                                                                                  end = min(hit end, prompt - 1)

The load starts where vLLM's local hit ends (possibly inside a chunk: only the rest of
that chunk is copied) and never covers the last prompt token, which vLLM must compute
to produce the first output token. It also ends on a block boundary: vLLM 0.32 expects
external hits in whole blocks (its ExampleConnector says so), and an external hit that
ended inside a block gave wrong logits on the CPU backend (seen here with 511 of 512).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare.integrations.vllm.metadata import LoadSpec
    from kvshare.layout import KVLayout


@dataclass(frozen=True)
class LookupWindow:
    """Chunks worth asking the pool for: indices ``first_chunk .. end_chunk - 1``."""

    first_chunk: int
    end_chunk: int

    @property
    def num_chunks(self) -> int:
        return max(self.end_chunk - self.first_chunk, 0)


def load_limit(num_prompt_tokens: int, block_size: int) -> int:
    """The end of the longest load vLLM accepts: whole blocks, at least one prompt token left over."""
    return max((num_prompt_tokens - 1) // block_size * block_size, 0)


def lookup_window(
    num_prompt_tokens: int, num_computed_tokens: int, chunk_tokens: int, block_size: int = 1
) -> LookupWindow:
    """The full chunks of the prompt that could extend vLLM's local hit of ``num_computed_tokens``."""
    if chunk_tokens <= 0 or block_size <= 0:
        raise ValueError(f"chunk_tokens and block_size must be positive, got {chunk_tokens} and {block_size}")
    if num_computed_tokens < 0:
        raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
    end_chunk = max(num_prompt_tokens, 0) // chunk_tokens
    if num_computed_tokens >= load_limit(num_prompt_tokens, block_size):  # nothing left that may be loaded
        return LookupWindow(end_chunk, end_chunk)
    return LookupWindow(min(num_computed_tokens // chunk_tokens, end_chunk), end_chunk)


def tokens_to_load(
    num_prompt_tokens: int,
    num_computed_tokens: int,
    chunk_tokens: int,
    first_chunk: int,
    num_hit_chunks: int,
    block_size: int = 1,
) -> int:
    """Tokens the pool supplies beyond ``num_computed_tokens``: whole blocks, at least one prompt token left."""
    if num_hit_chunks <= 0:
        return 0
    if first_chunk * chunk_tokens > num_computed_tokens:
        raise ValueError(
            f"the pool hit starts at token {first_chunk * chunk_tokens}, after the local hit ends "
            f"({num_computed_tokens}): the gap would be neither computed nor loaded"
        )
    hit_end = (first_chunk + num_hit_chunks) * chunk_tokens
    end = min(hit_end, load_limit(num_prompt_tokens, block_size))
    return max(end - num_computed_tokens, 0)


def may_skip_layer_hooks(num_scheduled_tokens, decode_tokens: int) -> bool:
    """Whether vLLM may run a step whose requests schedule ``num_scheduled_tokens`` (request id -> tokens) as one
    full CUDA graph: every request schedules at most a decode's tokens (1, plus speculative ones), as vLLM's
    uniform-decode batches do (FULL_AND_PIECEWISE replays them whole). Such a forward runs no attention layer's
    Python, so no ``wait_for_layer_load``: a load in the step must be complete before the forward starts (a
    request whose prompt is loaded up to its last token computes one token). Mixed steps run piecewise, with
    attention outside the graphs, and wait layer by layer."""
    return max(num_scheduled_tokens.values(), default=0) <= decode_tokens


def chunks_completed(computed_before: int, computed_after: int, num_prompt_tokens: int, chunk_tokens: int) -> range:
    """Full prompt chunks whose last token became computed in a step that took the request from
    ``computed_before`` to ``computed_after`` tokens (chunked prefill spreads a prompt over steps)::

        before = 300, after = 800, C = 256:  chunk 1 ends at 512, chunk 2 at 768 -> range(1, 3)
    """
    full_end = (max(num_prompt_tokens, 0) // chunk_tokens) * chunk_tokens
    after = min(computed_after, full_end)
    if after <= computed_before:
        return range(0)
    return range(computed_before // chunk_tokens, after // chunk_tokens)


@dataclass(frozen=True)
class PageSlice:
    """Tokens ``lo .. hi - 1`` of page ``page_index`` (chunk ``chunk``), at prompt position ``chunk * C + lo``."""

    page_index: int
    chunk: int
    lo: int
    hi: int

    @property
    def num_tokens(self) -> int:
        return self.hi - self.lo


def page_slices(
    token_start: int, token_end: int, first_chunk: int, num_pages: int, chunk_tokens: int
) -> list[PageSlice]:
    """Which part of each leased page a load of tokens ``token_start .. token_end - 1`` copies::

    pages         |--- chunk 4 ---|--- chunk 5 ---|--- chunk 6 ---|
    load                  [start .................... end)
    slices               (0, 4, lo, C)  (1, 5, 0, C)  (2, 6, 0, hi)
    """
    if token_end <= token_start:
        return []
    first_page_start = first_chunk * chunk_tokens
    if token_start < first_page_start or token_end > (first_chunk + num_pages) * chunk_tokens:
        raise ValueError(
            f"tokens [{token_start}, {token_end}) are not inside the leased chunks "
            f"{first_chunk}..{first_chunk + num_pages - 1} of {chunk_tokens} tokens"
        )
    slices = []
    for index in range(num_pages):
        chunk = first_chunk + index
        lo = max(token_start - chunk * chunk_tokens, 0)
        hi = min(token_end - chunk * chunk_tokens, chunk_tokens)
        if hi > lo:
            slices.append(PageSlice(index, chunk, lo, hi))
    return slices


def load_pieces(spec: LoadSpec, kv_layout: KVLayout) -> tuple[list[PageSlice], str]:
    """The page slices a load may copy, and why it ends before the spec does ("" if it need not)."""
    C, page_bytes = kv_layout.chunk_tokens, kv_layout.page_bytes
    covered_end = min(spec.token_end, (spec.first_chunk + len(spec.pages)) * C)
    if spec.token_start < spec.first_chunk * C or covered_end <= spec.token_start:
        return [], "no leased page covers the load"
    pieces = page_slices(spec.token_start, covered_end, spec.first_chunk, len(spec.pages), C)
    for index, piece in enumerate(pieces):  # read no further than a page of another size: not this model's
        if spec.pages[piece.page_index].page_bytes != page_bytes:
            size = spec.pages[piece.page_index].page_bytes
            return pieces[:index], f"page of {size} bytes, this model's pages have {page_bytes}"
    return pieces, ""


@dataclass(frozen=True)
class CopyRun:
    """Pages ``first .. first + num_pages - 1`` of a load, adjacent in the arena, each copied at ``lo .. hi - 1``."""

    first: int  # index into the slices (and pages) of the load
    num_pages: int
    lo: int
    hi: int


def copy_runs(
    slices: list[PageSlice], offsets: list[int], page_bytes: int, chunk_tokens: int, extent_bytes: int = 0
) -> list[CopyRun]:
    """Group a load's page slices into runs that one strided copy per layer can move::

        slices   (0..C) (0..C) (0..C) (0..hi)      offsets  p, p+1, p+2, q
        runs     [--- one run of 3 pages ---] [one]

    Whole pages merge while they lie back to back in the arena (the pool allocates a
    request's pages as runs) inside one extent (``extent_bytes`` > 0): a copy that spans
    two CUDA registrations fails; a partial page is always a run of its own.
    """
    runs: list[CopyRun] = []
    for i, piece in enumerate(slices):
        whole = piece.lo == 0 and piece.hi == chunk_tokens
        if runs and whole:
            last = runs[-1]
            j = last.first + last.num_pages - 1
            adjacent = offsets[j] + page_bytes == offsets[i] and slices[j].chunk + 1 == piece.chunk
            if extent_bytes and offsets[last.first] // extent_bytes != (offsets[i] + page_bytes - 1) // extent_bytes:
                adjacent = False
            if last.lo == 0 and last.hi == chunk_tokens and adjacent:
                runs[-1] = CopyRun(last.first, last.num_pages + 1, 0, chunk_tokens)
                continue
        runs.append(CopyRun(i, 1, piece.lo, piece.hi))
    return runs


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


def blocks_of_tokens(token_start: int, token_end: int, block_size: int, block_ids: list[int]) -> list[int]:
    """vLLM block ids that hold tokens ``token_start .. token_end - 1`` (for reporting load errors)."""
    if token_end <= token_start:
        return []
    first, last = token_start // block_size, (token_end - 1) // block_size
    if last >= len(block_ids):
        raise ValueError(f"token {token_end - 1} lies in block {last}, but the request has {len(block_ids)} blocks")
    return list(block_ids[first : last + 1])


# -- leases held for requests ----------------------------------------------------------


class LeaseState(enum.Enum):
    PENDING = "pending"  # looked up, vLLM has not allocated the blocks yet (may ask again)
    SCHEDULED = "scheduled"  # vLLM allocated blocks: the next step's metadata carries the load
    IN_FLIGHT = "in_flight"  # sent to the worker; released once the step that loaded has finished


@dataclass
class HeldLease:
    """One request's lease on a run of pool pages, and the load it backs."""

    lease_id: int
    first_chunk: int
    pages: list  # PageHeader-like: offset, page_bytes, checksum
    keys: list[bytes]  # keys of the leased chunks (to drop a page found bad)
    taken_at: float
    owner: tuple[bytes, bytes] = (b"", b"")  # (pool id, holder token) of the link that took it
    token_start: int = 0
    token_end: int = 0
    state: LeaseState = LeaseState.PENDING
    is_resumed: bool = False  # backs a request's load after a preemption (not its provenance)


class LeaseBook:
    """Leases per request id: at most one each, reused when vLLM asks again, expired after a TTL.

    The book only records; the caller talks to the pool (lookup, release) and passes ``now``.
    A lease sent to a worker is released when its load has finished, not when the TTL says:
    a page is never freed while it is copied (only a report lost for ten TTLs ends it).
    """

    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._held: dict[str, HeldLease] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._held

    def get(self, req_id: str) -> HeldLease | None:
        return self._held.get(req_id)

    def reusable(self, req_id: str, first_chunk: int, now: float) -> HeldLease | None:
        """The lease already held for this request, if it still serves a lookup from ``first_chunk``."""
        held = self._held.get(req_id)
        if held is None or held.state is not LeaseState.PENDING:
            return None
        if held.first_chunk != first_chunk or now - held.taken_at >= self.ttl_s:
            return None
        return held

    def put(self, req_id: str, lease: HeldLease) -> HeldLease | None:
        """Record ``lease`` for ``req_id``; returns the lease it replaces (the caller releases it)."""
        previous = self._held.get(req_id)
        if previous is not None and previous.state is LeaseState.IN_FLIGHT:
            raise ValueError(f"request {req_id} has a load in flight; its lease cannot be replaced")
        self._held[req_id] = lease
        return previous

    def pop(self, req_id: str) -> HeldLease | None:
        return self._held.pop(req_id, None)

    def mark(self, req_id: str, state: LeaseState) -> HeldLease:
        held = self._held[req_id]
        held.state = state
        return held

    def with_state(self, state: LeaseState) -> list[tuple[str, HeldLease]]:
        return [(req_id, held) for req_id, held in self._held.items() if held.state is state]

    def take_expired(self, now: float) -> list[HeldLease]:
        """Remove and return pending leases older than the TTL (requests vLLM never scheduled), and
        in-flight ones older than ``IN_FLIGHT_TTL_FACTOR`` TTLs (a step whose report never came)."""

        def is_expired(held: HeldLease) -> bool:
            age = now - held.taken_at
            if held.state is LeaseState.IN_FLIGHT:
                return age >= IN_FLIGHT_TTL_FACTOR * self.ttl_s
            return age >= self.ttl_s

        expired = [r for r, h in self._held.items() if is_expired(h)]
        return [self._held.pop(r) for r in expired]


IN_FLIGHT_TTL_FACTOR = 10  # a load takes a step (well under a second); ten TTLs means its report was lost
