"""The canonical state checkpoint: a hybrid model's recurrent state at one position, as one contiguous object.

A hybrid model (Gated DeltaNet layers between attention layers) carries, besides the attention layers' KV
(kvshare.layout), a state per GDN layer that sums up every token before it. A checkpoint holds all of them::

    checkpoint  |L0 recurrent|L0 conv|pad|L1 recurrent|L1 conv|pad| ... |L(n-1) recurrent|L(n-1) conv|pad|
                 <-------- layer_bytes -------->
    recurrent   [value_head][key_head_dim][value_head_dim] in recurrent_dtype (float32)
    conv        [conv_channel][conv_kernel - 1] in conv_dtype (the model's): the last kernel-1 inputs of the
                causal conv over the mixed q/k/v, oldest first

The GDN layers are numbered in model order (the n-th linear-attention layer is L(n)). Every layer starts on
an ALIGNMENT boundary, so each section is a typed view of the object without a copy; padding bytes are zero.
The engine's live state is itself laid out so (kvshare.engine.gdn_state): a checkpoint is a copy of its bytes,
and loading one is a copy back. Pure arithmetic, no torch: dtypes are named by string.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvshare.layout import DTYPE_ITEMSIZE

ALIGNMENT = 64  # bytes: a layer's recurrent state starts here, as float32 views and GPU kernels want it


@dataclass(frozen=True)
class StateLayout:
    """Shape of one hybrid model's GDN state as a checkpoint stores it."""

    num_layers: int  # GDN (linear-attention) layers
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_dim: int  # channels of the causal conv: 2 x key dim + value dim
    conv_kernel: int
    recurrent_dtype: str = "float32"
    conv_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_value_heads", "key_head_dim", "value_head_dim", "conv_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"StateLayout.{name} must be positive, got {getattr(self, name)}")
        if self.conv_kernel < 2:
            raise ValueError(f"StateLayout.conv_kernel must be at least 2, got {self.conv_kernel}")
        for name in ("recurrent_dtype", "conv_dtype"):
            if getattr(self, name) not in DTYPE_ITEMSIZE:
                raise ValueError(f"unsupported {name} {getattr(self, name)!r}; known: {sorted(DTYPE_ITEMSIZE)}")

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_bytes(self) -> int:
        """Bytes of one layer's recurrent state."""
        heads, keys, values = self.recurrent_shape
        return heads * keys * values * DTYPE_ITEMSIZE[self.recurrent_dtype]

    @property
    def conv_bytes(self) -> int:
        """Bytes of one layer's conv state."""
        channels, inputs = self.conv_shape
        return channels * inputs * DTYPE_ITEMSIZE[self.conv_dtype]

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's recurrent and conv states with the padding after them."""
        return -(-(self.recurrent_bytes + self.conv_bytes) // ALIGNMENT) * ALIGNMENT

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def recurrent_offset(self, layer: int) -> int:
        """Byte offset of GDN layer ``layer``'s recurrent state inside a checkpoint."""
        self._check(layer)
        return layer * self.layer_bytes

    def conv_offset(self, layer: int) -> int:
        """Byte offset of GDN layer ``layer``'s conv state inside a checkpoint."""
        return self.recurrent_offset(layer) + self.recurrent_bytes

    def fingerprint(self) -> str:
        """Short hex id of this layout: a checkpoint's header names it, so foreign bytes are refused."""
        text = ":".join(
            str(v)
            for v in (
                self.num_layers,
                self.num_value_heads,
                self.key_head_dim,
                self.value_head_dim,
                self.conv_dim,
                self.conv_kernel,
                self.recurrent_dtype,
                self.conv_dtype,
                ALIGNMENT,
            )
        )
        return hashlib.blake2b(b"kvshare-state-v1\0" + text.encode(), digest_size=8).hexdigest()

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"GDN layer {layer} outside 0..{self.num_layers - 1}")
