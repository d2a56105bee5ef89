"""A hybrid model's GDN checkpoint between the pool and vLLM's blocks on a GPU, through the staging pipeline.

The page crosses whole between the registered arena and one device buffer of a checkpoint (kvshare.transfer.state:
the built-in engine's copy and check), and between that buffer and vLLM's blocks on the GPU (state_blocks.StateBlocks,
which transposes the recurrent state to and from vLLM CUDA's [HV, V, K])::

    load   load copy stream:     (after vLLM's work so far and the buffer's last use) H2D page -> buffer
           load reshape stream:  (after vLLM's work so far) WSUM32 of the buffer (an XXH3 page: host threads)
                                 | StateBlocks.write buffer -> blocks | ``written``
           vLLM's stream:        a load beside the steps ends with the load's end event, after ``written``, and
                                 vLLM runs its request only once that end was seen; a load in a step makes vLLM's
                                 stream wait on ``written`` in start_load_kv, before the forward's first layer
    store  store reshape stream: (after vLLM's stream: the step that wrote the state; the buffer's last use)
                                 StateBlocks.read blocks -> buffer | WSUM32
           store copy stream:    D2H buffer -> page; the host waits for it, then the page is committed

A page that fails its check is in the blocks by then: the load fails whole (a hybrid's load is whole or nothing),
vLLM computes the request's whole prompt, from no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshare.integrations.vllm.state_blocks import StateBlocks
from kvshare.pool.protocol import PageHeader
from kvshare.transfer.pipeline import StagingPipeline
from kvshare.transfer.state import StateChecksumMismatch, StateLoad, cuda_load_state, cuda_store_state


@dataclass
class StateCopy:
    """A checkpoint's load in flight: the page's copy into the buffer and its check (``state``), and the event after
    its scatter into vLLM's blocks (``written``)."""

    state: StateLoad
    written: torch.cuda.Event

    def is_good(self) -> bool:
        """Whether the bytes copied are the page's (waits for the copy and its check)."""
        try:
            self.state.verify()
        except StateChecksumMismatch:
            return False
        return True


class GpuStates:
    """vLLM's GDN state tensors on one GPU and the device buffer a checkpoint crosses on its way."""

    def __init__(self, blocks: StateBlocks, pipeline: StagingPipeline) -> None:
        if blocks.device != pipeline.device:
            raise ValueError(f"GDN state on {blocks.device}, the staging pipeline on {pipeline.device}")
        self.blocks, self.pipeline = blocks, pipeline
        with torch.inference_mode():  # written where vLLM's (inference) tensors are read, and read where written
            self._buffer = torch.empty(blocks.layout.checkpoint_bytes, dtype=torch.uint8, device=pipeline.device)
        self._idle: torch.cuda.Event | None = None  # after the buffer's last use (None: never used)

    def _after_last_use(self, stream) -> None:
        if self._idle is not None:
            stream.wait_event(self._idle)

    @torch.inference_mode()
    def load(self, client, hasher, page: PageHeader, block_ids: tuple[int, ...]) -> StateCopy:
        """Enqueue the checkpoint ``page`` into block ``block_ids[l]`` of every GDN layer l, after vLLM's work so
        far; always checked (a resume stands on it whole)."""
        pipeline = self.pipeline
        lane = pipeline.load_lane
        self._after_last_use(lane.copy)
        state = cuda_load_state(pipeline, client, hasher, page, self._buffer, verify=True)
        landed = _recorded(lane.copy)
        pipeline.load_after(torch.cuda.current_stream(pipeline.device))  # vLLM's work on the blocks so far
        lane.reshape.wait_event(landed)
        with torch.cuda.stream(lane.reshape):
            self.blocks.write(self._buffer, block_ids)
        self._idle = _recorded(lane.reshape)
        return StateCopy(state, self._idle)

    @torch.inference_mode()
    def store(self, client, block_ids: tuple[int, ...], offset: int) -> int:
        """Copy the GDN state in ``block_ids`` into the reserved checkpoint page at ``offset`` once vLLM's work so far
        (the step that wrote it) has ended; the page's WSUM32. Returns once the copy has completed."""
        pipeline = self.pipeline
        lane = pipeline.store_lane
        pipeline.store_after(torch.cuda.current_stream(pipeline.device))
        self._after_last_use(lane.reshape)
        with torch.cuda.stream(lane.reshape):
            self.blocks.read(block_ids, self._buffer)
        checksum = cuda_store_state(pipeline, client, self._buffer, offset, producer_stream=lane.reshape)
        self._idle = _recorded(lane.copy)
        return checksum


def _recorded(stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event
