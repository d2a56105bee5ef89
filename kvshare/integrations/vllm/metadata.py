"""What the vLLM connector's scheduler side tells its worker side each step, and what comes back.

Plain frozen dataclasses, with the leased pages as the pool's (frozen) PageHeaders; no torch, no vLLM.
vLLM passes them between processes by pickling when the worker runs in another process, and by
reference otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvshare.pool.protocol import PageHeader


@dataclass(frozen=True)
class LoadSpec:
    """Copy prompt tokens ``token_start .. token_end - 1`` from leased pages into vLLM's blocks.

    ``pages[i]`` holds chunk ``first_chunk + i``; ``block_ids`` is the request's block table
    (block j holds tokens ``j * block_size ..``). ``pool_id`` names the pool the lease
    came from: a worker mapped onto another pool's arena must not read these offsets.
    """

    req_id: str
    pool_id: bytes
    first_chunk: int
    pages: tuple[PageHeader, ...]  # as the lease gave them
    keys: tuple[bytes, ...]
    token_start: int
    token_end: int
    block_ids: tuple[int, ...]
    # vLLM holds the request in WAITING_FOR_REMOTE_KVS while this load runs beside its steps (never scheduled
    # in them); the worker reports it in get_finished once its copies and checks have ended
    is_async: bool = False
    # a hybrid model's load: the leased checkpoint page of the GDN state after token_end (kvshare.state_layout), its
    # key (to drop it when bad) and, per GDN layer, the block vLLM resumes that layer's state from
    state_page: PageHeader | None = None
    state_key: bytes = b""
    state_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class StoreSpec:
    """After this step's forward, put chunks ``first_chunk ..`` (one per key) into the pool.

    With one rank the worker reserves and commits the pages itself. With tensor parallelism the
    scheduler has reserved them already (``reservation_id`` of the pool ``pool_id``; ``grants``:
    (index into keys, arena offset) of the chunks to write): each rank writes its heads and reports
    a StorePart, and the scheduler commits once every rank's part is in.
    """

    req_id: str
    namespace: bytes
    first_chunk: int
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    reservation_id: int = 0  # 0: not reserved yet (one rank)
    grants: tuple[tuple[int, int], ...] = ()
    pool_id: bytes = b""
    account: bytes = b""  # whose pool quota the pages count against (kvshare.pool.protocol.Reserve); b"": namespace
    # for the pool's KV events: the key of chunk first_chunk - 1 (b"": none), and the chunks' token ids where an
    # indexer may rehash them (None: a tenant's or an adapter's chunks, or a pool that publishes no events)
    parent_key: bytes = b""
    token_ids: tuple[int, ...] | None = None

    def reserve(self, client, page_bytes: int):
        """The pool's pages for these chunks (a PoolClient's reserve: only those it does not hold are granted)."""
        ids = None if self.token_ids is None else list(self.token_ids)
        return client.reserve(
            self.namespace,
            list(self.keys),
            page_bytes,
            self.first_chunk,
            token_ids=ids,
            account=self.account,
            parent_key=self.parent_key,
        )

    @property
    def is_parted(self) -> bool:
        """Whether the ranks write parts of pages the scheduler reserved."""
        return self.reservation_id != 0


@dataclass(frozen=True)
class StateStoreSpec:
    """After this step's forward, put a hybrid model's GDN state after ``num_chunks`` prompt chunks into the pool as
    the checkpoint keyed ``key`` (kvshare.keys.state_key of the chunk it ends), read from block ``blocks[l]`` of
    each GDN layer l (the step ended there: vLLM keeps the state in that block until its next step)."""

    req_id: str
    namespace: bytes
    num_chunks: int
    key: bytes
    blocks: tuple[int, ...]
    account: bytes = b""


@dataclass(frozen=True)
class StorePart:
    """Rank ``tp_rank``'s part of a reserved store: written (with its part of each granted page's WSUM32,
    in grant order) or not (``reason``), which aborts the whole reservation."""

    reservation_id: int
    pool_id: bytes  # the pool that granted the reservation: ids restart in every pool
    tp_rank: int
    is_written: bool
    checksums: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class StepPlan:
    """The connector's work for one engine step."""

    loads: tuple[LoadSpec, ...] = ()
    stores: tuple[StoreSpec, ...] = ()
    state_stores: tuple[StateStoreSpec, ...] = ()  # after the step's stores: their checkpoints follow their KV
    num_tokens: int = 0  # tokens vLLM computes in the step, all requests (for the timing log)
    # every request schedules at most a decode's tokens: vLLM may replay the step as one full CUDA graph, whose
    # forward calls no per-layer hook, so the step's loads complete before its forward starts
    no_layer_hooks: bool = False


@dataclass(frozen=True)
class LoadOutcome:
    """How a load went: tokens ``token_start .. loaded_end - 1`` are right in vLLM's blocks."""

    req_id: str
    token_start: int
    token_end: int
    loaded_end: int  # == token_end when the whole load succeeded
    reason: str = ""  # why it stopped early ("" when it did not)

    @property
    def is_complete(self) -> bool:
        return self.loaded_end == self.token_end

    @property
    def num_loaded(self) -> int:
        return self.loaded_end - self.token_start


@dataclass
class WorkerReport:
    """Worker -> scheduler, once per step: how each load of the step went."""

    loads: list[LoadOutcome] = field(default_factory=list)
    stores: list[StorePart] = field(default_factory=list)  # tensor parallel: each rank's part of its stores

    def merged(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(self.loads + other.loads, self.stores + other.stores)
