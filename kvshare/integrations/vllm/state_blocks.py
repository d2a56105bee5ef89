"""A hybrid model's GDN state in vLLM's blocks, to and from one canonical checkpoint page (kvshare.state_layout).

vLLM registers each GDN layer as ``[conv, ssm]``, both indexed by block id: views into the page the attention layers
share, conv first, then ssm, one state per block (as_strided with the page as the block stride)::

    conv   [B, kernel - 1, conv_dim]  ("SD", vLLM's default)  or  [B, conv_dim, kernel - 1] ("DS"), the model's dtype
    ssm    [B, HV, V, K] as vLLM's spec names it, in the recurrent dtype; in memory per block:
           "HKV" [HV, K, V]  vLLM CPU: its GDN kernel views the spec's shape as [HV, K, V]
           "HVK" [HV, V, K]  vLLM CUDA: the FLA Triton kernels index [HV, V, K], key dim innermost

    page   |L0 recurrent [HV, K, V]|L0 conv [conv_dim, kernel - 1]|pad|L1 ...|      (kvshare.state_layout)

The order is a fact of the vLLM version and device (hybrid.GDN_RECURRENT_ORDER), never guessed from shapes: with K ==
V, as in every Qwen3.5 and Qwen3-Next model, both orders have one shape. Where vLLM's sources say it (v0.26.0, the
GPU machine's; v0.32.0 agrees line for line unless named):

- shapes: ``MambaStateShapeCalculator.gated_delta_net_state_shape``, vllm/model_executor/layers/mamba/mamba_utils.py
  213-234 (0.32: 280-301): conv ``_orient_conv_shape(conv_dim, kernel - 1 + num_spec)``, temporal
  ``(num_v_heads, head_v_dim, head_k_dim)``. The conv orientation: ``get_conv_state_layout`` 27-43, "SD" unless
  ``VLLM_SSM_CONV_STATE_LAYOUT`` says "DS" (``is_conv_state_dim_first`` 46-48); vllm/platforms/cpu.py sets "SD"
  (0.26: 240-242; 0.32: 440, "DS" with a NIXL connector); nothing sets it on CUDA. The kernels read conv as
  ``[B, conv_dim, kernel - 1]`` (qwen_gdn_linear_attn.py 1229-1235: "SD" transposed).
- the pages: vllm/v1/worker/gpu_model_runner.py 7381-7403 (0.26), each state tensor ``as_strided`` with the page as
  block stride, ssm after conv; a block's state is contiguous. vllm/v1/worker/utils.py 538 binds the list to the
  layer's ``kv_cache`` in the forward context.
- dtypes: ``MambaStateDtypeCalculator._mamba_state_dtype`` (mamba_utils.py 84-96): conv in the model's dtype, the
  recurrent state in ``mamba_ssm_cache_dtype``, "auto" meaning the model's dtype. Qwen3.5 takes the config's
  ``mamba_ssm_dtype`` (float32; vllm/model_executor/models/config.py 744-768); vLLM CPU sets float32 where its
  accelerated GDN runs (0.26 platforms/cpu.py 128-134, with AMX; 0.32: 302-316, with AVX-512 BF16); CUDA changes
  nothing, so a Qwen3-Next keeps it in the model's dtype unless ``--mamba-ssm-cache-dtype float32``. The checkpoint
  layout takes the dtype vLLM resolved (hybrid_setup).
- CUDA order: chunked prefill, vllm/third_party/flash_linear_attention/ops/chunk_delta_h.py 108-114
  (``h0 + i_nh * V * K``, ``make_block_ptr(h0, (V, K), (K, 1), ...)``; 0.32: 108, 124), fed
  ``ssm_state[prefill_state_indices]`` and written back (qwen_gdn_linear_attn.py 1433-1452); decode, fused_recurrent.py
  119 and 302 and fused_sigmoid_gating.py 119 (``h0 + state_idx * stride + i_hv * V * K + o_v * K + o_k``; 0.32:
  fused_recurrent.py 119, 306): [HV, V, K] with K innermost. On SM90 vLLM 0.26 picks FlashInfer's GDN prefill
  (qwen_gdn_linear_attn.py 85-133) over the same tensor; the decode kernels above read what it leaves.
- CPU order: vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py views ``[slots, HV, V, K]`` as
  ``[slots, HV, K, V]`` without a copy (0.26: 123-124, 264-267; 0.32: 232-233, 373-376).

A load writes layer l's sections into block ``blocks[l]`` of its two tensors; a store reads them from there, each
recurrent state through the view its order gives (a transpose for "HVK", run by torch where the tensors are: on the
GPU for CUDA blocks), the conv state transposed from "SD". The page is uint8 bytes on the blocks' device: the pool's
page itself on CPU, a device buffer the GPU worker stages it through (gpu_states).
"""

from __future__ import annotations

import numpy as np
import torch

from kvshare.state_layout import StateLayout
from kvshare.transfer.layouts import as_bits, torch_dtype

HKV = "HKV"  # a block's recurrent state in memory: [value head][key dim][value dim], the checkpoint's order
HVK = "HVK"  # [value head][value dim][key dim]: transposed to and from the checkpoint
RECURRENT_ORDERS = (HKV, HVK)


class StateBlocks:
    """One vLLM worker's GDN state tensors, per GDN layer in model order, and copies of one state to a page.

    ``recurrent_order``: how a block's recurrent state lies in memory (hybrid.recurrent_order of the vLLM version
    and device that registered ``layers``)."""

    def __init__(
        self, layout: StateLayout, layers: list[tuple[torch.Tensor, torch.Tensor]], recurrent_order: str
    ) -> None:
        if recurrent_order not in RECURRENT_ORDERS:
            raise ValueError(f"unknown GDN recurrent state order {recurrent_order!r}; known: {RECURRENT_ORDERS}")
        if len(layers) != layout.num_layers:
            raise ValueError(f"vLLM registered {len(layers)} GDN layers, the checkpoint layout has {layout.num_layers}")
        self.layout, self.recurrent_order = layout, recurrent_order
        self._conv, self._ssm = [], []
        for index, (conv, ssm) in enumerate(layers):
            self._conv.append(as_bits(_conv_view(layout, index, conv)))
            self._ssm.append(as_bits(_recurrent_view(layout, index, ssm, recurrent_order)))
        self.device = self._ssm[0].device if self._ssm else torch.device("cpu")

    def _sections(self, raw: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s recurrent [HV, K, V] and conv [conv_dim, kernel - 1] sections of the page bytes ``raw``
        as integer views."""
        layout = self.layout
        start = layout.recurrent_offset(index)
        recurrent = raw[start : start + layout.recurrent_bytes].view(self._ssm[index].dtype)
        start = layout.conv_offset(index)
        conv = raw[start : start + layout.conv_bytes].view(self._conv[index].dtype)
        return recurrent.view(layout.recurrent_shape), conv.view(layout.conv_shape)

    def _page_bytes(self, page: np.ndarray | torch.Tensor) -> torch.Tensor:
        """``page`` as contiguous uint8 bytes of one checkpoint, on the blocks' device (never copied across)."""
        raw = torch.from_numpy(page) if isinstance(page, np.ndarray) else page
        if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
            raise ValueError(f"a checkpoint page is contiguous uint8 bytes, got {raw.dtype} {tuple(raw.shape)}")
        if raw.numel() != self.layout.checkpoint_bytes:
            raise ValueError(f"{raw.numel()} bytes do not hold a checkpoint of {self.layout.checkpoint_bytes}")
        if raw.device != self.device:
            raise ValueError(f"a checkpoint page on {raw.device} for GDN state on {self.device}: stage it there first")
        return raw

    def write(self, page: np.ndarray | torch.Tensor, blocks: tuple[int, ...]) -> None:
        """The checkpoint in ``page`` into block ``blocks[l]`` of every GDN layer l (on a GPU: enqueued on the
        current stream)."""
        raw = self._page_bytes(page)
        for index, block in enumerate(blocks):
            recurrent, conv = self._sections(raw, index)
            self._ssm[index][block].copy_(recurrent)
            self._conv[index][block].copy_(conv)

    def read(self, blocks: tuple[int, ...], page: np.ndarray | torch.Tensor) -> None:
        """Every GDN layer l's state in block ``blocks[l]`` into ``page`` (its padding zeroed; on a GPU: enqueued on
        the current stream)."""
        raw = self._page_bytes(page)
        raw.zero_()
        for index, block in enumerate(blocks):
            recurrent, conv = self._sections(raw, index)
            recurrent.copy_(self._ssm[index][block])
            conv.copy_(self._conv[index][block])


def _conv_view(layout: StateLayout, index: int, conv: torch.Tensor) -> torch.Tensor:
    """GDN layer ``index``'s conv state as ``[B, conv_dim, kernel - 1]`` (an "SD" tensor transposed), checked."""
    channels, inputs = layout.conv_shape
    if conv.dim() == 3 and tuple(conv.shape[1:]) == (inputs, channels):
        conv = conv.transpose(1, 2)  # "SD" -> [B, conv_dim, kernel - 1]
    if conv.dim() != 3 or tuple(conv.shape[1:]) != (channels, inputs):
        raise ValueError(f"GDN layer {index}: conv state {tuple(conv.shape)} is not [B, {channels}, {inputs}] or SD")
    if conv.dtype != torch_dtype(layout.conv_dtype):
        raise ValueError(f"GDN layer {index}: conv state in {conv.dtype}, the checkpoint's is {layout.conv_dtype}")
    return conv


def _recurrent_view(layout: StateLayout, index: int, ssm: torch.Tensor, order: str) -> torch.Tensor:
    """GDN layer ``index``'s recurrent state as ``[B, HV, K, V]`` in the checkpoint's element order: the block's
    bytes reinterpreted ("HKV") or the spec's [HV, V, K] transposed ("HVK"), checked."""
    heads, keys, values = layout.recurrent_shape
    where = f"GDN layer {index}: ssm state {tuple(ssm.shape)}"
    if ssm.dim() != 4 or ssm[0].numel() * ssm.element_size() != layout.recurrent_bytes:
        raise ValueError(f"{where} is not {layout.recurrent_bytes} B a block")
    if ssm.dtype != torch_dtype(layout.recurrent_dtype):
        raise ValueError(f"{where} in {ssm.dtype}, the checkpoint's is {layout.recurrent_dtype}")
    if not ssm[0].is_contiguous():
        raise ValueError(f"{where}: a block's ssm state is not contiguous (strides {ssm.stride()})")
    if order == HKV:
        return ssm.flatten(1).unflatten(1, (heads, keys, values))  # the same bytes, read as [HV, K, V]
    if tuple(ssm.shape[1:]) != (heads, values, keys):
        raise ValueError(f"{where} is not vLLM's [B, {heads}, {values}, {keys}] of order {order}")
    return ssm.transpose(2, 3)  # [B, HV, V, K] -> [B, HV, K, V], a strided view
