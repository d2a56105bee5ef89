"""The one GPU staging pipeline: pool pages <-> pinned (registered) arena <-> GPU staging <-> an engine's KV.

Both engines move KV through it; each supplies only its KV layout (a ``KVDestination``) and its call order
(the built-in engine: kvshare.transfer.cuda; vLLM: kvshare.integrations.vllm.gpu)::

    load   lane copy stream:    H2D unit0 -> buf0 | H2D unit1 -> buf1 | H2D unit2 -> buf0 (after scatter0) ...
           lane reshape stream:      scatter+WSUM32 buf0 -> KV | scatter+WSUM32 buf1 -> KV | ...  event per group
    ahead  any stream:          H2D units -> a caller's device buffer (``prefetch``), long before the load
           lane reshape stream: (waits for those copies) scatter+WSUM32 buffer -> KV: a unit whose ``source``
                                is that buffer skips its H2D
    store  producer stream:     ... kernels writing the KV | event
           lane reshape stream: (waits on it) gather KV -> buf0, WSUM32 | gather KV -> buf1, WSUM32 | ...
           lane copy stream:          D2H buf0 -> pages | D2H buf1 -> pages | ...

A unit is a group of layers over a block of pages (kvshare.transfer.plan); each run of pages in it that
lies back to back inside one extent (one CUDA registration) is one 2-D copy (kvshare.transfer.copiers),
every host range checked to lie inside one registration. The reshape (token/head transpose, or vLLM's
block scatter) runs on the GPU at HBM speed; WSUM32 is summed over the staged bytes (kvshare.pool.wsum).

Lifetime: nothing this pipeline copies to or from is given up while a copy on it may still run.
A staging buffer is refilled only after the event of its last use (``StagingLane.idle``); the arena's
registration is released (or swapped for another arena's) only after both lanes' streams and the streams of
copies ahead (``ahead_streams``) ended, and ``release_registration`` waits for the device again before it
unpins; ``close`` and ``sync`` wait for every copy enqueued here. A caller gives pool pages back only after
``sync`` or the end event of the load, store or copy ahead that touched them.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol

import torch

from kvshare.layout import KVLayout
from kvshare.pool.wsum import add_head_rows, add_rows, as_unsigned
from kvshare.transfer.base import TransferConfig
from kvshare.transfer.copiers import make_copier
from kvshare.transfer.layouts import bits_dtype, chunks_view
from kvshare.transfer.plan import RowCopy, Unit, head_copies, layer_groups, load_units, pages_per_unit, plan_unit
from kvshare.transfer.registration import ArenaRegistration, acquire_registration, release_registration


class KVDestination(Protocol):
    """An engine's KV as the pipeline reads and writes it: where a unit's staged pages go and come from.

    ``staged`` is the unit's pages in a staging buffer as integers of the KV's width,
    ``[n, g, 2, C, h, D]`` (n = unit.num_pages, g = unit.num_layers, h: the heads the engine's KV holds
    on a store, every head of the page on a load). Both are enqueued on the current (reshape) stream."""

    def scatter(self, unit: Unit, staged: torch.Tensor) -> None:
        """The staged pages' tokens into the engine's KV (a load)."""

    def gather(self, unit: Unit, staged: torch.Tensor) -> None:
        """The engine's KV into the staged pages (a store)."""


class UnitWork(NamedTuple):
    """One unit of a load or store, the KV it moves to or from, and its pages' WSUM32 accumulators
    (``[unit.num_pages]`` int64 on the device; None: not summed). A load unit's ``source``: its pages' rows
    already on the device (``prefetch``), packed as a staging buffer packs them, ready once ``ready`` (an
    event) has completed; None: copied from the arena into a staging buffer here."""

    unit: Unit
    destination: KVDestination
    sums: torch.Tensor | None
    source: torch.Tensor | None = None
    ready: object = None


class StagingLane:
    """A copy stream, a reshape stream and the staging buffers rotating between them, each with the
    event of its last use: a buffer is refilled only once that event has completed on the stream."""

    def __init__(self, device: torch.device, num_buffers: int, buffer_bytes: int) -> None:
        # high priority: the scatters get SMs ahead of long compute kernels, so the copies keep flowing
        self.copy = torch.cuda.Stream(device, priority=-1)
        self.reshape = torch.cuda.Stream(device, priority=-1)
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, device=device) for _ in range(num_buffers)]
        self.idle = [torch.cuda.Event() for _ in range(num_buffers)]
        self._next = 0

    def take(self) -> int:
        """The next buffer in turn (the caller orders its use after ``idle[index]``)."""
        index = self._next
        self._next = (index + 1) % len(self.buffers)
        return index

    def synchronize(self) -> None:
        self.copy.synchronize()
        self.reshape.synchronize()


class StagingPipeline:
    """Streams, rotating staging buffers, the 2-D copier and the arena's registration of one device.

    ``shared_lane``: loads and stores use one lane (a caller that never runs both at once, the built-in
    engine); else each direction has its own (vLLM overlaps a step's stores with its loads).
    ``load_groups``: the layer groups a load's units follow (default ``layer_groups`` of min_copy_bytes).
    ``heads``: (first, count) of the page's KV heads the engine's KV holds (None: all); a store writes only
    those. ``warm_up_with``: a scratch destination whose kernels run once at the first registration."""

    def __init__(
        self,
        layout: KVLayout,
        config: TransferConfig,
        device,
        shared_lane: bool,
        load_groups: Sequence[tuple[int, int]] | None = None,
        heads: tuple[int, int] | None = None,
        warm_up_with: KVDestination | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.layout, self.config, self.device = layout, config, device
        self.copier = make_copier(config.copy_method, device.index or 0)  # fails before anything is allocated
        self.store_groups = layer_groups(layout.num_layers, layout.layer_bytes, config.min_copy_bytes)
        self.load_groups = list(load_groups) if load_groups is not None else self.store_groups
        self.group_of_layer = [g for g, (l0, l1) in enumerate(self.load_groups) for _ in range(l0, l1)]
        widest = max(l1 - l0 for l0, l1 in self.store_groups) * layout.layer_bytes
        pages_per_unit(config.staging_bytes, widest)  # refuses staging that cannot hold one page's row
        self.heads = heads if heads is not None and heads[1] != layout.num_kv_heads else None
        if self.heads is not None and (layout.head_dim * layout.itemsize) % 4:
            raise ValueError(
                f"a head of {layout.head_dim} x {layout.itemsize} bytes is not a whole number "
                "of 32-bit words: a part of a page's WSUM32 cannot be summed"
            )
        with self._on_device():
            self.load_lane = StagingLane(device, config.staging_buffers, config.staging_bytes)
            self.store_lane = (
                self.load_lane if shared_lane else StagingLane(device, config.staging_buffers, config.staging_bytes)
            )
        self.registration: ArenaRegistration | None = None
        self._registered_arena = None  # the mapping registered (kept alive while it is)
        self.registered_pool_id = b""  # the pool whose arena that is
        # copies ahead of a load (``prefetch``) run on these, from another thread than the hooks': the lock orders
        # their enqueueing against a change of registration, which waits for these streams too (``sync``)
        self.registration_lock = threading.RLock()
        self.ahead_streams: list = []
        self._warm_up_with = warm_up_with
        self._closed = False

    @property
    def is_sliced(self) -> bool:
        """Whether the engine's KV holds only some of a page's heads (a tensor parallel rank)."""
        return self.heads is not None

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _lanes(self) -> list[StagingLane]:
        return [self.load_lane] if self.store_lane is self.load_lane else [self.load_lane, self.store_lane]

    # -- the arena ---------------------------------------------------------------------------------

    def ensure_registered(self, client) -> None:
        """Register the client's arena with CUDA once per mapping (in extent pieces). A failed registration
        raises: never a silent fall back to pageable memory. Another arena's registration is released
        first, once every copy enqueued here has ended."""
        if self._closed:
            raise RuntimeError("this staging pipeline is closed")
        with self.registration_lock:
            if self.is_registered(client):
                return
            self._release_registration()
            self.registration = acquire_registration(client)
            self._registered_arena = client.arena
            self.registered_pool_id = client.hello.pool_id
        if self._warm_up_with is not None:  # once, at the first registration (start-up)
            destination, self._warm_up_with = self._warm_up_with, None
            self.warm_up(destination)

    def is_registered(self, client) -> bool:
        """Whether ``client``'s arena mapping is the one registered with CUDA now."""
        return self.registration is not None and self._registered_arena is client.arena

    def _release_registration(self) -> None:
        with self.registration_lock:  # no copy ahead is enqueued meanwhile
            if self.registration is not None:
                self.sync()  # no copy of ours may touch the pins as they go
                registration, self.registration, self._registered_arena = self.registration, None, None
                self.registered_pool_id = b""
                release_registration(registration)

    @torch.inference_mode()
    def warm_up(self, destination: KVDestination) -> None:
        """Run every kernel a load or store launches once, on one scratch page row through ``destination``
        (scratch KV of the engine's dtype): CUDA loads kernels lazily, and a fresh vLLM replica's first store
        paid ~70 ms for that on the H200 (Qwen3-8B shape, 32k)."""
        unit = plan_unit([0], self.layout, (0, 1), (0, 1), None)
        with self._on_device(), torch.cuda.stream(self.load_lane.reshape):
            scratch = torch.zeros(unit.num_bytes, dtype=torch.uint8, device=self.device)
            destination.scatter(unit, self.staged(scratch, unit))
            destination.gather(unit, self.packed(scratch, unit))
            acc = torch.zeros(1, dtype=torch.int64, device=self.device)
            add_rows(acc, self.rows(scratch, unit), 0)
            self._add_store_sums(acc, scratch, unit)
            as_unsigned(acc)  # the read back (synchronizes this stream)

    # -- units and views ---------------------------------------------------------------------------

    def plan_groups(
        self,
        offsets: Sequence[int],
        extent_bytes: int | None,
        groups: Sequence[tuple[int, int]] | None = None,
        first_page: int = 0,
    ) -> Iterator[list[Unit]]:
        """The units moving whole pages at ``offsets`` (from ``first_page`` on), per layer group (default: the
        load's) in layer order (lazy)."""
        cfg, groups = self.config, self.load_groups if groups is None else groups
        return load_units(offsets, self.layout, cfg.min_copy_bytes, cfg.staging_bytes, extent_bytes, groups, first_page)

    def staged(self, buffer: torch.Tensor, unit: Unit) -> torch.Tensor:
        """The unit's whole pages in ``buffer``: integers ``[n, g, 2, C, H, D]`` (no copy)."""
        return chunks_view(buffer, self.layout, unit.num_pages, unit.num_layers)

    def packed(self, buffer: torch.Tensor, unit: Unit) -> torch.Tensor:
        """Where a store's gather writes in ``buffer``: ``[n, g, 2, C, h, D]`` (h: the heads the KV holds)."""
        if self.heads is None:
            return self.staged(buffer, unit)
        layout, h = self.layout, self.heads[1]
        shape = (unit.num_pages, unit.num_layers, 2, layout.chunk_tokens, h, layout.head_dim)
        num_bytes = unit.num_pages * unit.row_bytes * h // layout.num_kv_heads
        return buffer[:num_bytes].view(bits_dtype(layout.itemsize)).view(shape)

    def rows(self, buffer: torch.Tensor, unit: Unit) -> torch.Tensor:
        """The unit's staged pages as 32-bit words ``[n, g * layer_bytes / 4]`` (for WSUM32)."""
        return buffer[: unit.num_bytes].view(torch.int32).view(unit.num_pages, -1)

    def word_offset(self, unit: Unit) -> int:
        """Where the unit's rows start in each page, in 32-bit words."""
        return unit.layer_start * self.layout.layer_bytes // 4

    def store_copies(self, unit: Unit) -> tuple[RowCopy, ...]:
        """The 2-D copies that write a store unit's staged bytes into its pages (some heads: only theirs)."""
        if self.heads is None:
            return unit.copies
        return head_copies(unit, self.layout, self.heads[0], self.heads[1])

    def _add_store_sums(self, acc: torch.Tensor, buffer: torch.Tensor, unit: Unit) -> None:
        """``acc`` (one int64 per page of the unit) += the WSUM32 terms of the staged bytes: the pages' whole
        rows, or the held heads' part of them (the parts of every head sum to the page's)."""
        if self.heads is None:
            add_rows(acc, self.rows(buffer, unit), self.word_offset(unit))
            return
        C, rows = self.layout.chunk_tokens, unit.num_layers * 2 * self.layout.chunk_tokens
        words = self.packed(buffer, unit).view(torch.int32)  # [n, g, 2, C, h, W]
        add_head_rows(
            acc,
            words.view(unit.num_pages, rows, self.heads[1], -1),
            unit.layer_start * 2 * C,
            self.heads[0],
            self.layout.num_kv_heads,
        )

    def host_copies(self, copies: Sequence[RowCopy], buffer: torch.Tensor, stream, client, to_device: bool) -> None:
        """2-D copies between registered pages and ``buffer``, enqueued on ``stream``."""
        if self.registration is None:
            raise RuntimeError("the pool arena is not registered with CUDA (ensure_registered first)")
        for c in copies:  # no copy may span two registrations ("invalid argument" on the H200)
            self.registration.check_span(c.host_offset, (c.height - 1) * c.host_pitch + c.width)
        self.copier.copy(copies, client, self.registration.base_ptr, buffer, stream, to_device)

    # -- ordering ----------------------------------------------------------------------------------

    def load_after(self, stream) -> None:
        """A load's scatters write the KV only after ``stream``'s work so far (the caller's reads and writes)."""
        ready = torch.cuda.Event()
        ready.record(stream)
        self.load_lane.reshape.wait_event(ready)

    def store_after(self, producer) -> None:
        """A store's first read of the KV waits for the kernels ``producer`` enqueued so far."""
        produced = torch.cuda.Event()
        produced.record(producer)
        self.order_after_producer(self.store_lane.reshape, produced)

    def order_after_producer(self, stream, produced) -> None:
        """The one place a store waits for its producer: the dependency the study's bug lacked (the
        validation's deliberately broken controls override it)."""
        stream.wait_event(produced)

    # -- the two loops -----------------------------------------------------------------------------

    def load_steps(
        self,
        client,
        groups: Iterable[Sequence[UnitWork]],
        start,
        end,
        record_group: Callable[[int, object], None],
        failed: Callable[[Exception], None],
        first_copy: Callable[[float], None] | None = None,
    ) -> Iterator[int]:
        """Enqueue a load's copies and scatters group by group, yielding after each group's event is recorded
        (``record_group(group, stream)``). ``groups`` may be lazy: planning counts as enqueueing.

        Never raises: an error goes to ``failed``. ``start`` is recorded before the first copy, ``end``
        after whatever was enqueued, when the groups run out, fail, or the generator is closed."""
        lane, cfg = self.load_lane, self.config
        try:
            # inference mode and the device are thread-local and entered per group: never held across a
            # yield, which would leak them into the caller's code between groups
            with torch.inference_mode(), self._on_device():
                start.record(lane.copy)
                if cfg.load_delay_cycles:  # validation: a late copy stream, which a reader that does not wait races
                    with torch.cuda.stream(lane.copy):
                        torch.cuda._sleep(cfg.load_delay_cycles)
            pending = iter(groups)
            for group in itertools.count():
                with torch.inference_mode(), self._on_device():
                    works = next(pending, None)  # planned here, under the same modes as its copies
                    if works is None:
                        return
                    for work in works:
                        if work.source is not None:  # prefetched: no staging buffer, no copy here
                            lane.reshape.wait_event(work.ready)
                            self._scatter(work, work.source)
                            continue
                        index = lane.take()
                        buffer = lane.buffers[index]
                        lane.copy.wait_event(lane.idle[index])  # the previous scatter out of this buffer is done
                        self.host_copies(work.unit.copies, buffer, lane.copy, client, to_device=True)
                        if first_copy is not None:
                            first_copy(time.perf_counter())
                            first_copy = None
                        copied = torch.cuda.Event()
                        copied.record(lane.copy)
                        lane.reshape.wait_event(copied)
                        self._scatter(work, buffer)
                        lane.idle[index].record(lane.reshape)
                    record_group(group, lane.reshape)
                yield group
        except Exception as exc:  # noqa: BLE001 - handed to the reader through ``failed``
            failed(exc)
        finally:
            last = torch.cuda.Event()
            last.record(lane.copy)
            lane.reshape.wait_event(last)
            end.record(lane.reshape)

    def _scatter(self, work: UnitWork, buffer: torch.Tensor) -> None:
        """A load unit's staged pages in ``buffer`` into the KV, summed as they are (a bad copy is caught as well
        as a bad page); enqueued on the load lane's reshape stream."""
        with torch.cuda.stream(self.load_lane.reshape):
            work.destination.scatter(work.unit, self.staged(buffer, work.unit))
            if work.sums is not None:
                add_rows(work.sums, self.rows(buffer, work.unit), self.word_offset(work.unit))

    def prefetch(self, client, units: Sequence[Unit], buffers: Sequence[torch.Tensor], stream) -> None:
        """Enqueue on ``stream`` the H2D copies of ``units`` from the registered arena into ``buffers`` (one each,
        packed as a staging buffer: ``staged(buffer, unit)`` reads it), for a load's later ``UnitWork.source``.
        The caller orders its readers after ``stream``'s work and keeps the pages held until the copies ended.
        From any thread: under ``registration_lock``, and only into the arena registered now (``is_registered``),
        since the hooks' thread registers it; ``stream`` must be one of ``ahead_streams`` (synced before the
        registration goes)."""
        if stream not in self.ahead_streams:
            raise ValueError("prefetch on a stream the pipeline does not wait for before unpinning the arena")
        if len(units) != len(buffers):
            raise ValueError(f"{len(units)} units for {len(buffers)} buffers")
        for unit, buffer in zip(units, buffers):
            if buffer.numel() < unit.num_bytes:
                raise ValueError(f"a buffer of {buffer.numel()} bytes for a unit of {unit.num_bytes}")
            self.host_copies(unit.copies, buffer, stream, client, to_device=True)

    @torch.inference_mode()  # the KV may be an inference tensor
    def store_steps(self, client, works: Iterable[UnitWork]) -> None:
        """Enqueue a store's gathers and copies, unit by unit, on the store lane (after ``store_after``).
        The copies have completed once an event recorded after this on ``store_lane.copy`` has."""
        lane = self.store_lane
        for unit, destination, sums, *_ in works:  # a store's units have no source
            index = lane.take()
            buffer = lane.buffers[index]
            lane.reshape.wait_event(lane.idle[index])  # the previous copy out of this buffer is done
            with torch.cuda.stream(lane.reshape):
                destination.gather(unit, self.packed(buffer, unit))
                if sums is not None:  # the staged bytes, which the copy below writes to the pages
                    self._add_store_sums(sums, buffer, unit)
            gathered = torch.cuda.Event()
            gathered.record(lane.reshape)
            lane.copy.wait_event(gathered)
            self.host_copies(self.store_copies(unit), buffer, lane.copy, client, to_device=False)
            lane.idle[index].record(lane.copy)

    # -- the end -----------------------------------------------------------------------------------

    def sync(self) -> None:
        """Wait until every copy and kernel enqueued here (the copies ahead too) has ended."""
        for lane in self._lanes():
            lane.synchronize()
        for stream in self.ahead_streams:
            stream.synchronize()

    def close(self) -> None:
        """Wait for every copy, then unpin the arena (its registration's last user) and drop the buffers."""
        if self._closed:
            return
        with self.registration_lock:
            self.sync()
            self._closed = True
        try:
            self._release_registration()
        finally:
            for lane in self._lanes():
                lane.buffers = []
