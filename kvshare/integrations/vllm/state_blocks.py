"""A hybrid model's GDN state in vLLM's blocks, to and from one canonical checkpoint page (kvshare.state_layout).

vLLM registers each GDN layer as ``[conv, ssm]``, both indexed by block id (views into the blocks the attention layers
share, one state per block)::

    conv   [B, kernel - 1, conv_dim]  ("SD", vLLM CPU)  or  [B, conv_dim, kernel - 1] ("DS"), the model's dtype
    ssm    [B, HV, V, K] as vLLM's spec names it, float32; vLLM CPU's GDN kernel reads each block as [HV, K, V]

    page   |L0 recurrent [HV, K, V]|L0 conv [conv_dim, kernel - 1]|pad|L1 ...|      (kvshare.state_layout)

A load writes layer l's sections into block ``blocks[l]`` of its two tensors; a store reads them from there. The
recurrent state moves as the bytes vLLM CPU's kernel reads as [HV, K, V] (the layout fingerprint names the device,
so pages of another device's vLLM are never read as these); the conv state is transposed from "SD". CPU only.
"""

from __future__ import annotations

import numpy as np
import torch

from kvshare.state_layout import StateLayout
from kvshare.transfer.layouts import as_bits


class StateBlocks:
    """One vLLM CPU worker's GDN state tensors, per GDN layer in model order, and copies of one state to a page."""

    def __init__(self, layout: StateLayout, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(layers) != layout.num_layers:
            raise ValueError(f"vLLM registered {len(layers)} GDN layers, the checkpoint layout has {layout.num_layers}")
        self.layout = layout
        channels, inputs = layout.conv_shape
        self._conv, self._ssm = [], []
        for index, (conv, ssm) in enumerate(layers):
            if conv.device.type != "cpu":
                raise ValueError(f"GDN state on {conv.device}: kvshare moves it on CPU only")
            if tuple(conv.shape[1:]) == (inputs, channels):
                conv = conv.transpose(1, 2)  # "SD" -> [B, conv_dim, kernel - 1]
            conv_bytes = conv.element_size() * channels * inputs
            if tuple(conv.shape[1:]) != (channels, inputs) or conv_bytes != layout.conv_bytes:
                raise ValueError(f"GDN layer {index}: conv state {tuple(conv.shape)} is not {layout.conv_shape}")
            if ssm.dim() != 4 or ssm[0].numel() * ssm.element_size() != layout.recurrent_bytes:
                raise ValueError(f"GDN layer {index}: ssm state {tuple(ssm.shape)} is not {layout.recurrent_bytes} B")
            if not ssm[0].is_contiguous():
                raise ValueError(f"GDN layer {index}: a block's ssm state is not contiguous (strides {ssm.stride()})")
            self._conv.append(as_bits(conv))
            self._ssm.append(as_bits(ssm).flatten(1))  # [B, HV * K * V] as the kernel reads it

    def _sections(self, page: np.ndarray, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s recurrent and conv sections of ``page`` (uint8 bytes) as integer views."""
        layout, raw = self.layout, torch.from_numpy(page)
        start = layout.recurrent_offset(index)
        recurrent = raw[start : start + layout.recurrent_bytes].view(self._ssm[index].dtype)
        start = layout.conv_offset(index)
        conv = raw[start : start + layout.conv_bytes].view(self._conv[index].dtype).view(layout.conv_shape)
        return recurrent, conv

    def write(self, page: np.ndarray, blocks: tuple[int, ...]) -> None:
        """The checkpoint in ``page`` into block ``blocks[l]`` of every GDN layer l."""
        for index, block in enumerate(blocks):
            recurrent, conv = self._sections(page, index)
            self._ssm[index][block].copy_(recurrent)
            self._conv[index][block].copy_(conv)

    def read(self, blocks: tuple[int, ...], page: np.ndarray) -> None:
        """Every GDN layer l's state in block ``blocks[l]`` into ``page`` (its padding zeroed)."""
        page[:] = 0
        for index, block in enumerate(blocks):
            recurrent, conv = self._sections(page, index)
            recurrent.copy_(self._ssm[index][block])
            conv.copy_(self._conv[index][block])
