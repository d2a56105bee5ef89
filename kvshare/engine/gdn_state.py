"""One sequence's Gated DeltaNet state, kept in the canonical checkpoint layout (kvshare.state_layout).

Imports only torch and the pure layout. The live state is one contiguous byte buffer on the model's device;
each GDN layer reads and writes its recurrent state ``[HV, K, V]`` (float32) and conv state ``[C, W-1]`` through
typed views into it, so a checkpoint is a copy of the buffer and loading one is a copy back::

    buffer    |L0 recurrent|L0 conv|pad|L1 recurrent|L1 conv|pad| ...      (kvshare.state_layout)
    position  the tokens the state has seen: a forward from ``position`` may run, from anywhere else not

The position is what keeps a state from being combined with KV it does not belong to: the model refuses a
forward that does not start where its state ends (kvshare.engine.hybrid_model), and a checkpoint carries the
position it was taken at.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvshare.state_layout import StateLayout


@dataclass(frozen=True)
class Checkpoint:
    """The state after the first ``position`` tokens: ``data`` [checkpoint_bytes] uint8 in the canonical layout."""

    position: int
    data: Tensor

    @property
    def num_bytes(self) -> int:
        return self.data.numel()


class GDNState:
    """The live state of the sequence the model is computing (one at a time, as the engine's KV)."""

    def __init__(self, layout: StateLayout, device: torch.device) -> None:
        self.layout = layout
        self.buffer = torch.zeros(layout.checkpoint_bytes, dtype=torch.uint8, device=device)
        self.recurrent, self.conv = layer_views(layout, self.buffer)
        self.position = 0

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def reset(self) -> None:
        """The state before the first token: zeros."""
        self.buffer.zero_()
        self.position = 0

    def snapshot(self) -> Checkpoint:
        """A copy of the state as it is now."""
        return Checkpoint(self.position, self.buffer.clone())

    def restore(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint`` (bytes in this layout, on any device)."""
        if checkpoint.num_bytes != self.layout.checkpoint_bytes:
            raise ValueError(
                f"a checkpoint of {checkpoint.num_bytes} bytes does not fit the state's "
                f"{self.layout.checkpoint_bytes}-byte layout"
            )
        self.buffer.copy_(checkpoint.data)
        self.position = checkpoint.position

    def empty_checkpoint(self, position: int) -> Checkpoint:
        """A checkpoint for ``position`` that a forward fills layer by layer (``copy_layer``); padding zero."""
        return Checkpoint(position, torch.zeros_like(self.buffer))

    def copy_layer(self, layer: int, into: Checkpoint) -> None:
        """GDN layer ``layer``'s recurrent and conv states, as they are now, into ``into``'s bytes."""
        start = self.layout.recurrent_offset(layer)
        end = self.layout.conv_offset(layer) + self.layout.conv_bytes
        into.data[start:end].copy_(self.buffer[start:end])


def layer_views(layout: StateLayout, buffer: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """Per GDN layer, typed views of ``buffer`` (a checkpoint's bytes): recurrent [HV, K, V] and conv [C, W-1]."""
    recurrent, conv = [], []
    rec_dtype, conv_dtype = getattr(torch, layout.recurrent_dtype), getattr(torch, layout.conv_dtype)
    for layer in range(layout.num_layers):
        r = layout.recurrent_offset(layer)
        c = layout.conv_offset(layer)
        recurrent.append(buffer[r : r + layout.recurrent_bytes].view(rec_dtype).view(layout.recurrent_shape))
        conv.append(buffer[c : c + layout.conv_bytes].view(conv_dtype).view(layout.conv_shape))
    return recurrent, conv
