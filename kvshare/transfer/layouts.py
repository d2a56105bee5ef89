"""Conversions between the built-in engine's KV and the canonical page ``[L, 2, C, H, D]``.

    engine      kv [L, 2, H, T, D]        the built-in engine's sequence KV (head-major)
    pages       [n, L, 2, C, H, D]        n canonical pages (chunks of C tokens)

Checked against the slow, index-by-index versions in ``reference.py``. vLLM's paged
layouts (CPU attention, flash attention) live with the connector, in
``kvshare.integrations.vllm.layout``, which tells them apart by the attention backend.

Every copy runs on integer views of the same width (``as_bits``), so bytes move
exactly (NaN payloads included) whatever the KV dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvshare.layout import KVLayout
    from kvshare.transfer.plan import Unit

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; known: {sorted(TORCH_DTYPES)}") from None


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an integer tensor of the same element width (same shape and strides)."""
    return t.view(_BITS[t.element_size()])


def bits_dtype(itemsize: int) -> torch.dtype:
    return _BITS[itemsize]


def chunks_view(buf: torch.Tensor, layout: KVLayout, num_pages: int, num_layers: int | None = None) -> torch.Tensor:
    """The first bytes of a 1-D uint8 buffer as packed page rows [n, L', 2, C, H, D] (integer view, no copy).

    With ``num_layers`` = L' < L each row is a group of layers of a page, as a staging buffer holds them.
    """
    num_layers = layout.num_layers if num_layers is None else num_layers
    shape = (num_pages, num_layers, 2, layout.chunk_tokens, layout.num_kv_heads, layout.head_dim)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError("chunks_view needs a contiguous 1-D uint8 buffer")
    return buf[: num_pages * num_layers * layout.layer_bytes].view(bits_dtype(layout.itemsize)).view(shape)


# -- built-in engine: kv [L, 2, H, T, D] <-> chunks [n, L, 2, C, H, D] --------------------------


def _engine_window(kv: torch.Tensor, chunks: torch.Tensor, first_token: int) -> torch.Tensor:
    if kv.dim() != 5 or chunks.dim() != 6:
        raise ValueError(
            f"expected kv [L, 2, H, T, D] and chunks [n, L, 2, C, H, D], got {tuple(kv.shape)}, {tuple(chunks.shape)}"
        )
    n, num_layers, two, c, h, d = chunks.shape
    if (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != (num_layers, two, h, d):
        raise ValueError(f"kv {tuple(kv.shape)} does not match chunks {tuple(chunks.shape)}")
    if kv.dtype != chunks.dtype:
        raise ValueError(f"kv dtype {kv.dtype} != chunks dtype {chunks.dtype}")
    if first_token < 0 or first_token + n * c > kv.shape[3]:
        raise ValueError(f"tokens [{first_token}, {first_token + n * c}) exceed the kv capacity {kv.shape[3]}")
    return kv[:, :, :, first_token : first_token + n * c, :].unflatten(3, (n, c))  # [L, 2, H, n, C, D]


def chunks_to_engine(kv: torch.Tensor, chunks: torch.Tensor, first_token: int) -> None:
    """kv[:, :, :, first_token : first_token + n*C, :] <- chunks (the token/head transpose)."""
    _engine_window(kv, chunks, first_token).copy_(chunks.permute(1, 2, 4, 0, 3, 5))


def engine_to_chunks(chunks: torch.Tensor, kv: torch.Tensor, first_token: int) -> None:
    """chunks <- kv[:, :, :, first_token : first_token + n*C, :] in canonical order."""
    chunks.copy_(_engine_window(kv, chunks, first_token).permute(3, 0, 1, 4, 2, 5))


class EngineKV:
    """The built-in engine's kv ``[L, 2, H, T, D]`` (an integer view) as the staging pipeline's destination:
    chunk ``first_chunk + i`` of the request lives in page i of a call."""

    def __init__(self, kv_bits: torch.Tensor, first_chunk: int, chunk_tokens: int) -> None:
        self.kv, self.first_chunk, self.chunk_tokens = kv_bits, first_chunk, chunk_tokens

    def _first_token(self, unit: Unit) -> int:
        return (self.first_chunk + unit.page_start) * self.chunk_tokens

    def scatter(self, unit: Unit, staged: torch.Tensor) -> None:
        """Staged pages ``[n, g, 2, C, H, D]`` into the unit's layers and tokens of kv."""
        chunks_to_engine(self.kv[unit.layer_start : unit.layer_stop], staged, self._first_token(unit))

    def gather(self, unit: Unit, staged: torch.Tensor) -> None:
        """The unit's layers and tokens of kv into staged pages ``[n, g, 2, C, H, D]``."""
        engine_to_chunks(staged, self.kv[unit.layer_start : unit.layer_stop], self._first_token(unit))
