"""What the connector checks before it shares a model's KV: the layout fingerprint, models with state
other than attention KV, the KV dtype.

Pure: duck-typed over vLLM's config objects (``KVCacheConfig``, its groups and specs), so it is
tested with stand-ins; nothing here imports vLLM.

- The **layout fingerprint** names how this engine's KV bytes were read into pages: vLLM's
  version (major.minor), the device and attention backend, vLLM's resolved KV layout, the block
  size, the KV dtype and whether each layer has its own tensor. It is part of the key namespace,
  so a change of any of them (a vLLM upgrade that packs the layout differently, a new backend)
  starts from an empty pool instead of reading old pages as new ones. The tensor parallel size is
  not in it: pages hold every KV head whatever the TP size (kvshare.integrations.vllm.tensor_parallel).
- A model whose cache groups are not all plain full attention (Mamba or linear-attention state,
  sliding-window or chunked-local layers, packed or quantised pages) is not shared at all: its
  requests get 0 pool tokens and nothing is stored, never a restore of the attention part only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# vLLM's --kv-cache-dtype -> the torch dtype name of the pages (fp8 is e4m3 in vLLM)
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_dtype_of(cache_dtype: str | None, model_dtype: str) -> str:
    """The pages' dtype: the model's for ``auto``, else the fp8 kind; anything else is refused by name."""
    if cache_dtype in (None, "auto"):
        return model_dtype
    if cache_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[cache_dtype]
    raise ValueError(
        f"kvshare stores KV in the model's dtype or fp8; --kv-cache-dtype {cache_dtype} is not supported "
        f"(supported: auto, {', '.join(KV_CACHE_DTYPES)})"
    )


def non_attention_state(kv_cache_config: Any) -> str | None:
    """Why the model's cache cannot be shared through pages of attention KV (None: it can).

    One cache group of plain full attention is what pages hold (a hybrid of it and Gated DeltaNet layers moves its
    state apart: kvshare.integrations.vllm.hybrid); anything else is named."""
    if kv_cache_config is None:
        return None
    groups = list(kv_cache_config.kv_cache_groups)
    kinds = sorted({type(group.kv_cache_spec).__name__ for group in groups})
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups ({', '.join(kinds)}): a hybrid model, state not moved"
    spec = groups[0].kv_cache_spec
    if not _is_plain_full_attention(spec):
        return f"its layers keep {type(spec).__name__} state, not plain full-attention KV"
    if getattr(spec, "sliding_window", None) is not None or getattr(spec, "attention_chunk_size", None) is not None:
        return "sliding-window or chunked-local attention layers"
    if getattr(spec, "num_head_slots", None) is not None or getattr(spec, "state_content_bytes", None) is not None:
        return "a packed KV page layout"
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
        return f"KV quantisation mode {getattr(mode, 'name', mode)} (scales beside the KV)"
    return None


def _is_plain_full_attention(spec: Any) -> bool:
    """FullAttentionSpec itself (its subclasses, MLA and the like, store other things)."""
    return type(spec).__name__ == "FullAttentionSpec"


def allocation_of(kv_cache_config: Any) -> str:
    """How vLLM placed the layers' KV: ``per_layer`` (a tensor each), ``layer_outer`` (one allocation, each
    layer's blocks together) or ``block_outer`` (one allocation, each block packing every layer's page: the
    cross-layer layout); several kinds joined by ``+``."""
    if kv_cache_config is None:
        return "per_layer"
    kinds = set()
    for tensor in kv_cache_config.kv_cache_tensors:
        layers = getattr(tensor, "layers", None)
        layers = list(layers if layers is not None else getattr(tensor, "shared_by", ()))
        if len(layers) <= 1:
            kinds.add("per_layer")
        else:
            kinds.add(
                "block_outer"
                if getattr(tensor, "layer_stride", 0) < getattr(tensor, "block_stride", 0)
                else "layer_outer"
            )
    return "+".join(sorted(kinds)) or "per_layer"


# which paged layout kinds (kvshare.integrations.vllm.layout) a device's backends give the connector
LAYOUT_KINDS = {"cpu": ("cpu_attn",), "cuda": ("flash_attn", "flash_attn_5d")}


@dataclass(frozen=True)
class LayoutFingerprint:
    """How this engine lays out KV, as far as reading it into pages depends on it."""

    vllm_version: str  # major.minor
    device: str  # "cpu" | "cuda": which LAYOUT_KINDS the worker may find
    attention_backend: str  # as configured ("auto": vLLM's choice for the device)
    kv_cache_layout: str  # vLLM's resolved layout ("NHD", "HND"; "" when it does not say)
    block_size: int
    kv_dtype: str
    allocation: str  # allocation_of: "per_layer" | "layer_outer" | "block_outer"

    def text(self) -> str:
        """The fingerprint as the namespace carries it; ``pages=all_heads``: any TP size reads the same pages."""
        return (
            f"vllm{self.vllm_version}|{self.device}|{self.attention_backend}|{self.kv_cache_layout or '-'}"
            f"|block{self.block_size}|{self.kv_dtype}|{self.allocation}|pages=all_heads"
        )

    def check_kind(self, kind: str) -> None:
        """Refuse a paged layout the fingerprint did not promise (the namespace would then name the wrong one)."""
        if kind not in LAYOUT_KINDS.get(self.device, ()):
            raise ValueError(
                f"vLLM's KV tensors read as {kind!r}, but this replica's namespace fingerprint "
                f"({self.text()}) expects {LAYOUT_KINDS.get(self.device, ())}"
            )


def version_of(vllm_version: str) -> str:
    """major.minor of a vLLM version string (the connector's hooks and layouts change between minors)."""
    return ".".join(vllm_version.split("+")[0].split(".")[:2])
