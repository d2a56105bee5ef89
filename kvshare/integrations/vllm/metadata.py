"""What the vLLM connector's scheduler side tells its worker side each step, and what comes back.

Plain frozen dataclasses, with the leased pages as the pool's (frozen) PageHeaders; no torch, no vLLM.
vLLM passes them between processes by pickling when the worker runs in another process, and by
reference otherwise.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, fields

from kvshare.pool.protocol import PageHeader

log = logging.getLogger("kvshare.integrations")


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
class ConnectorCounters:
    """Monotonic counters of one connector side; summed across sides and steps for /metrics."""

    lookups: int = 0  # pool lookups (one per request asked about, reuse of a lease excluded)
    hit_tokens: int = 0  # tokens vLLM was told the pool will supply
    loaded_tokens: int = 0  # tokens copied into vLLM's KV and verified
    load_bytes: int = 0
    load_seconds: float = 0.0
    stored_chunks: int = 0  # pages committed to the pool
    store_bytes: int = 0
    store_seconds: float = 0.0
    skipped_stores: int = 0  # chunks the pool had no room for
    verified_pages: int = 0  # loaded pages whose checksum was checked (all, or the sampled share)
    checksum_failures: int = 0  # pages whose bytes did not match their commit checksum
    load_failures: int = 0  # loads stopped early (checksum, lease lost, pool gone): recomputed
    pool_errors: int = 0  # failed calls to the pool daemon
    expired_leases: int = 0  # leases released because vLLM never scheduled the request

    def add(self, other: ConnectorCounters | dict) -> None:
        values = other if isinstance(other, dict) else asdict(other)
        for f in fields(self):
            if f.name in values:
                setattr(self, f.name, getattr(self, f.name) + values[f.name])

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def is_zero(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))

    def count_load(
        self, spec: LoadSpec, loaded_end: int, reason: str, times: PhaseTimes, bytes_per_token: int, threads: int
    ) -> LoadOutcome:
        """Count and log a finished load (``loaded_end``: where its trusted tokens end); its outcome."""
        num_loaded = loaded_end - spec.token_start
        self.loaded_tokens += num_loaded
        self.load_bytes += num_loaded * bytes_per_token
        self.load_seconds += times.total
        log.debug("kvshare timing: load %s tokens=%d threads=%d %s", spec.req_id, num_loaded, threads, times.line())
        if loaded_end == spec.token_end:
            return LoadOutcome(spec.req_id, spec.token_start, spec.token_end, loaded_end)
        self.load_failures += 1
        log.warning(
            "kvshare: load for request %s stopped at token %d of %d..%d: %s; vLLM recomputes the rest",
            spec.req_id,
            loaded_end,
            spec.token_start,
            spec.token_end,
            reason,
        )
        return LoadOutcome(spec.req_id, spec.token_start, spec.token_end, loaded_end, reason)

    def take(self) -> ConnectorCounters:
        """This interval's counts; resets them here."""
        taken = ConnectorCounters(**asdict(self))
        for f in fields(self):
            setattr(self, f.name, f.default)
        return taken


COUNTER_NAMES = tuple(f.name for f in fields(ConnectorCounters))


@dataclass
class WorkerReport:
    """Worker -> scheduler, once per step: how each load of the step went."""

    loads: list[LoadOutcome] = field(default_factory=list)
    stores: list[StorePart] = field(default_factory=list)  # tensor parallel: each rank's part of its stores

    def merged(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(self.loads + other.loads, self.stores + other.stores)

    def loads_by_request(self) -> list[LoadOutcome]:
        """One outcome per request: with tensor parallelism every rank reports its load, and the tokens
        loaded are those every rank loaded (the shortest; vLLM recomputes the rest on all ranks)."""
        merged: dict[str, LoadOutcome] = {}
        for outcome in self.loads:
            held = merged.get(outcome.req_id)
            if held is None or outcome.loaded_end < held.loaded_end:
                merged[outcome.req_id] = outcome
        return list(merged.values())


class PhaseTimes:
    """Wall-clock seconds per named phase of one operation, for the connector's timing log::

    times = PhaseTimes(); ...; times.mark("verify"); ...; times.mark("copy")
    times.line() -> "verify=12.1ms copy=30.2ms total=42.3ms thread_cpu=40.0ms"
    """

    def __init__(self, clock=time.perf_counter, cpu_clock=time.thread_time) -> None:
        self._clock, self._cpu_clock = clock, cpu_clock
        self._started = self._last = clock()
        self._cpu_started = self._cpu_last = cpu_clock()
        self._elsewhere = 0.0  # seconds added for work other threads did (add)
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark (or the start) to ``phase``."""
        now = self._clock()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last, self._cpu_last = now, self._cpu_clock()

    def add(self, phase: str, seconds: float) -> None:
        """Charge ``seconds`` another thread spent to ``phase`` (and to the total)."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self._elsewhere += seconds

    @property
    def total(self) -> float:
        return self._last - self._started + self._elsewhere

    @property
    def cpu(self) -> float:
        """CPU seconds of the calling thread up to the last mark: far below ``total`` means it waited
        (for the GIL, for cores other processes held, for OpenMP threads)."""
        return self._cpu_last - self._cpu_started

    def line(self) -> str:
        parts = [f"{name}={seconds * 1e3:.1f}ms" for name, seconds in self.seconds.items()]
        return " ".join(parts + [f"total={self.total * 1e3:.1f}ms", f"thread_cpu={self.cpu * 1e3:.1f}ms"])
