"""A hybrid model's state checkpoint between a pool page and the engine's live GDN state, on CPU and CUDA.

A checkpoint (kvshare.state_layout) is one page of ``checkpoint_bytes`` in the canonical layout, which is also the
layout of the engine's live state buffer (kvshare.engine.gdn_state): moving one is one contiguous copy, no
reshape. Each transfer (kvshare.transfer.cpu, kvshare.transfer.cuda) offers ``load_state`` and ``store_state``
through the functions here, over its client, checksum threads and (CUDA) its pipeline's copy stream; vLLM's GPU
worker moves its hybrid checkpoints through the same CUDA functions, into and out of a device buffer it then
scatters to vLLM's blocks (kvshare.integrations.vllm.gpu_states)::

    load   CPU   check (by the page's kind) -> copy page -> state            done when load_state returns
           CUDA  copy stream: (after the caller's work on the state) H2D page -> state | ``copied``
                 reshape stream: (after ``copied``) WSUM32 of the landed bytes; XXH3 pages on host threads
                 the compute stream waits on ``copied`` before the first GDN layer (``StateLoad.wait``)
    store  CPU   copy state bytes -> page, XXH3
           CUDA  copy stream: (after the producer) D2H bytes -> page; WSUM32 of the same bytes on the reshape stream

A bad page is reported by ``StateLoad.verify`` (CPU: raised by the load, before any byte moved): the caller
resumes from a shallower state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.client import ChecksumMismatch
from kvshare.pool.protocol import FORMAT_VERSION
from kvshare.pool.wsum import add_rows, as_unsigned
from kvshare.transfer.plan import RowCopy
from kvshare.transfer.verify import PageCheck

if TYPE_CHECKING:
    from kvshare.pool.protocol import PageHeader


class StateChecksumMismatch(ChecksumMismatch):
    """A state checkpoint's page failed its checksum (in the pool, or in the copy)."""

    def __init__(self, offset: int) -> None:
        super().__init__(f"the state checkpoint at arena offset {offset} does not match its checksum")
        self.offset = offset


class StateLoad:
    """A checkpoint's copy into the live state: ``wait`` orders the compute after it, ``verify`` checks it.

    ``landed``: CUDA, the event after the copy (the compute waits on it); ``checked``: the event after the copy's
    check on the device (verify waits on it). Both None: the copy ended with the call (CPU)."""

    def __init__(self, num_bytes: int, offset: int, check: PageCheck | None = None, landed=None, checked=None) -> None:
        self.num_bytes, self._offset, self._check = num_bytes, offset, check
        self._landed, self._checked = landed, checked if checked is not None else landed
        self.seconds: float | None = None

    def wait(self, device: torch.device) -> None:
        """Make the current (compute) stream wait until the state has landed."""
        if self._landed is not None:
            torch.cuda.current_stream(device).wait_event(self._landed)

    def verify(self) -> None:
        """Wait for the copy and its check; raise StateChecksumMismatch when the bytes are not the page's."""
        if self._checked is not None:
            self._checked.synchronize()
        check, self._check = self._check, None
        if check is not None and check.bad_pages():
            raise StateChecksumMismatch(self._offset)


def check_state_page(page: PageHeader, into: torch.Tensor) -> None:
    """The page holds a checkpoint of ``into``'s size in this format; ``into`` is a contiguous byte buffer."""
    if into.dtype != torch.uint8 or into.dim() != 1 or not into.is_contiguous():
        raise ValueError(f"a state buffer is contiguous uint8 bytes, got {into.dtype} of shape {tuple(into.shape)}")
    if page.page_bytes != into.numel():
        raise ValueError(f"a checkpoint page of {page.page_bytes} bytes does not fit a state of {into.numel()}")
    if page.format_version != FORMAT_VERSION:
        raise StateChecksumMismatch(page.offset)


def cpu_load_state(transfer, page: PageHeader, into: torch.Tensor) -> StateLoad:
    """Check the page (when chosen, as a KV page is), then copy it into ``into``; done on return."""
    check_state_page(page, into)
    start = time.perf_counter()
    view = transfer.client.page(page.offset, page.page_bytes)
    if transfer._pages_to_verify(1) and not transfer._hasher.valid([view], [page])[0]:
        raise StateChecksumMismatch(page.offset)
    into.copy_(torch.from_numpy(view))
    load = StateLoad(page.page_bytes, page.offset)
    load.seconds = time.perf_counter() - start
    return load


def cpu_store_state(transfer, data: torch.Tensor, offset: int) -> int:
    """Copy a checkpoint's bytes into the reserved page at ``offset``; its XXH3."""
    view = transfer.client.page(offset, data.numel())
    torch.from_numpy(view).copy_(data)
    return transfer._hasher.checksums([view], ChecksumKind.XXH3)[0]


def cuda_load_state(pipeline, client, hasher, page: PageHeader, into: torch.Tensor, verify: bool) -> StateLoad:
    """Enqueue the page's copy into ``into`` on ``pipeline``'s load lane copy stream, after the caller's work so far
    (which may still read the state); checked when ``verify``: a WSUM32 page summed over the landed bytes on the
    reshape stream, an XXH3 one on ``hasher``'s threads."""
    check_state_page(page, into)
    lane, device, delay_cycles = pipeline.load_lane, pipeline.device, pipeline.config.load_delay_cycles
    lane.copy.wait_event(_recorded(torch.cuda.current_stream(device)))
    if delay_cycles:  # validation: a late copy, which a reader that does not wait races
        with torch.cuda.stream(lane.copy):
            torch.cuda._sleep(delay_cycles)
    check = PageCheck([page], [0] if verify else [], client, hasher, device, on_device=True)
    pipeline.host_copies([_one_row(page.offset, page.page_bytes)], into, lane.copy, client, to_device=True)
    landed = _recorded(lane.copy)
    sums = check.staged_sums(0, 1)
    if sums is None:
        return StateLoad(page.page_bytes, page.offset, check, landed)
    lane.reshape.wait_event(landed)
    with torch.cuda.stream(lane.reshape):
        add_rows(sums, into.view(torch.int32).view(1, -1), 0)
    return StateLoad(page.page_bytes, page.offset, check, landed, checked=_recorded(lane.reshape))


def _recorded(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


def cuda_store_state(pipeline, client, data: torch.Tensor, offset: int, producer_stream=None) -> int:
    """Copy a checkpoint's bytes (on the device) into the reserved page at ``offset`` through ``pipeline``'s store
    lane once the producer's work so far has ended; WSUM32 of the bytes copied, summed on the device. Returns once
    the copy has completed."""
    lane, device = pipeline.store_lane, pipeline.device
    producer = producer_stream if producer_stream is not None else torch.cuda.current_stream(device)
    pipeline.store_after(producer)  # the store lane's reshape stream waits for the producer
    with torch.cuda.stream(lane.reshape):
        acc = torch.zeros(1, dtype=torch.int64, device=device)
        add_rows(acc, data.view(torch.int32).view(1, -1), 0)
    lane.copy.wait_event(_recorded(lane.reshape))
    data.record_stream(lane.copy)
    pipeline.host_copies([_one_row(offset, data.numel())], data, lane.copy, client, to_device=False)
    _recorded(lane.copy).synchronize()
    with torch.cuda.stream(lane.reshape):
        return as_unsigned(acc)[0]


def _one_row(offset: int, num_bytes: int) -> RowCopy:
    """A whole page as one copy (a page never straddles an extent: one registration)."""
    return RowCopy(host_offset=offset, host_pitch=num_bytes, stage_offset=0, width=num_bytes, height=1)
