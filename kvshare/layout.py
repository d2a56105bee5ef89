"""The canonical page format: one chunk of one model's KV.

A page is ``[layer][k, v][token][kv_head][head_dim]`` in the model's KV dtype::

    page  |L0 K|L0 V|L1 K|L1 V| ... |L(n-1) K|L(n-1) V|
           <-slab->                  each slab: [chunk_tokens][kv_heads][head_dim]

Each (layer, k|v) slab is contiguous, so a loader can move one layer at a time,
and a layer's K and V slabs are adjacent (one 2*slab_bytes region per layer).
Pure arithmetic, no torch: dtypes are named by string.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvshare.keys import DEFAULT_CHUNK_TOKENS

# bytes per element of every KV dtype kvshare stores
DTYPE_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

K, V = 0, 1


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV as the pool stores it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; known: {sorted(DTYPE_ITEMSIZE)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def token_row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer: [kv_head][head_dim]."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def slab_bytes(self) -> int:
        """Bytes of one (layer, k|v) slab: [chunk_tokens][kv_head][head_dim]."""
        return self.chunk_tokens * self.token_row_bytes

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K and V slabs together (adjacent in a page)."""
        return 2 * self.slab_bytes

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token costs across all layers (K and V)."""
        return self.num_layers * 2 * self.token_row_bytes

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.chunk_tokens, self.num_kv_heads, self.head_dim)

    def slab_offset(self, layer: int, kv: int) -> int:
        """Byte offset of the (layer, k|v) slab inside a page."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        if kv not in (K, V):
            raise IndexError(f"kv must be 0 (K) or 1 (V), got {kv}")
        return (layer * 2 + kv) * self.slab_bytes

    def fingerprint(self) -> str:
        """Short hex id of this layout, stored in page headers to refuse foreign bytes."""
        text = f"{self.num_layers}:{self.num_kv_heads}:{self.head_dim}:{self.dtype}:{self.chunk_tokens}"
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
