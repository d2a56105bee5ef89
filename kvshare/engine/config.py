"""Model and engine configuration: what the built-in engine runs, and how.

``ModelConfig`` is read from a Hugging Face ``config.json`` (or a preset) and
refuses, by name, every feature the plain-torch decoder does not implement:
better a clear error at load than plausible but wrong logits.
No torch here: dtypes are named by string.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvshare.engine.hybrid_config import (
    FULL_ATTENTION,
    QWEN3_5_MOE_TYPES,
    QWEN3_5_TYPES,
    LinearAttentionConfig,
    qwen3_5_fields,
)
from kvshare.engine.unsupported import UnsupportedModel, refuse
from kvshare.keys import DEFAULT_CHUNK_TOKENS

# a hybrid's state checkpoints every this many chunks: at the 27B shape a checkpoint (147 MiB) is 14% of the KV of
# the 64 chunks before it (1 GiB), and a prompt that diverges mid-way recomputes 32 chunks on average
DEFAULT_STATE_CHECKPOINT_CHUNKS = 64

if TYPE_CHECKING:
    from kvshare.pool.event_publisher import KVEventsConfig

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_5")
CUDA_GRID_TOKENS = 2048  # the deterministic mode's default grid on CUDA (rounded up to a multiple of the chunk)
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# --kv-dtype: the storage dtype of the sequence KV (and so of the pool's pages); "auto" is the model's dtype.
# fp8 is float8_e4m3fn with one per-tensor scale of 1.0 for K and V (vLLM's default without calibrated
# scales): values are clamped to +-448 and cast; attention upcasts the cached K/V to the model's dtype.
KV_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}
KV_DTYPE_CHOICES = ("auto", *KV_DTYPES)
ATTENTION_CHOICES = ("auto", "flash", "sdpa")  # a prefill's attention (kvshare.engine.flash)
FP8_KV_SCALE = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Llama / Qwen2 / Qwen3 decoder, or of a Qwen3.5 hybrid (kvshare.engine.hybrid_config)."""

    arch: str  # "llama" | "qwen2" | "qwen3" | "qwen3_5"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 with attention_bias)
    mlp_bias: bool = False  # Llama's mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k before RoPE
    dtype: str = "float32"
    # a hybrid's layers (Qwen3.5): each "full_attention" or "linear_attention" (Gated DeltaNet); empty: every layer
    # is full attention. Qwen3.5's attention also gates its output and scales its norms by (1 + weight).
    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0  # the leading dims of each head that RoPE rotates; 0: all of head_dim
    linear_attention: LinearAttentionConfig | None = None  # the Gated DeltaNet layers' shapes (a hybrid's)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModel(
                f"architecture {self.arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedModel(f"dtype {self.dtype!r} is not supported (supported: {', '.join(SUPPORTED_DTYPES)})")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise UnsupportedModel(f"head_dim {self.head_dim} is odd (RoPE needs pairs)")
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise UnsupportedModel(f"rotary_dim {self.rotary_dim} is odd or outside 0..head_dim {self.head_dim}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
        if self.is_hybrid and (self.linear_attention is None or self.arch != "qwen3_5"):
            raise UnsupportedModel(f"linear-attention layers need the qwen3_5 architecture's shapes, not {self.arch!r}")

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (Gated DeltaNet): their state is recurrent, not KV."""
        return any(t != FULL_ATTENTION for t in self.layer_types)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep KV (every layer of a model without layer_types)."""
        return tuple(i for i in range(self.num_layers) if not self.layer_types or self.layer_types[i] == FULL_ATTENTION)

    @property
    def num_kv_layers(self) -> int:
        """Layers in the KV layout: the attention layers (a hybrid's GDN layers keep a state instead)."""
        return len(self.attention_layers)

    @property
    def num_linear_layers(self) -> int:
        return self.num_layers - self.num_kv_layers

    @property
    def rope_dim(self) -> int:
        """Dims of each head that RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return self.num_kv_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    def identity_fields(self) -> dict:
        """The fields that name this configuration (kvshare.keys.config_fingerprint): every field, the hybrid ones
        left out of a model without them, so an attention model's fingerprint stays what it was before they existed."""
        fields = asdict(self)
        if not self.is_hybrid:
            for name in ("layer_types", "rotary_dim", "linear_attention"):
                del fields[name]
        return fields


def kv_storage_dtype(kv_dtype: str, model_dtype: str) -> str:
    """The KV storage dtype's name (kvshare.layout.DTYPE_ITEMSIZE) for a --kv-dtype choice and the model's dtype."""
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPE_CHOICES}, got {kv_dtype!r}")
    return model_dtype if kv_dtype == "auto" else KV_DTYPES[kv_dtype]


def kv_precision(storage_dtype: str) -> str:
    """The namespace's kv_precision for a storage dtype: how stored values relate to the computed ones.

    A float8 cache stores round(clamp(x / scale)); its scale is part of what the bytes mean, so a replica
    with another scale never reads these pages. Other dtypes store the values as computed ("native").
    """
    return f"e4m3 scale {FP8_KV_SCALE}" if storage_dtype == "float8_e4m3fn" else "native"


def _rope_theta(hf: dict) -> float:
    """RoPE base, refusing every scaling variant (yarn, linear, dynamic, llama3, longrope, ...)."""
    legacy = hf.get("rope_scaling")
    params = hf.get("rope_parameters")
    for source, block in (("rope_scaling", legacy), ("rope_parameters", params)):
        if not block:
            continue
        kind = block.get("rope_type", block.get("type", "default"))
        if kind not in (None, "default"):
            raise refuse(f"rope scaling variant {kind!r}", f"{source} = {block}")
    theta = (params or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse("partial rotary embeddings", f"partial_rotary_factor = {hf['partial_rotary_factor']}")
    return float(theta)


def _refuse_unsupported(hf: dict, model_type: str) -> None:
    if model_type in QWEN3_5_MOE_TYPES:
        raise refuse("mixture-of-experts layers (MoE)", f"model_type = {model_type!r}")
    if model_type not in SUPPORTED_ARCHS:
        raise refuse(f"model_type {model_type!r}", f"supported: {', '.join(SUPPORTED_ARCHS)}")
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"):
        if hf.get(key):
            raise refuse("mixture-of-experts layers (MoE)", f"{key} = {hf[key]}")
    if hf.get("use_sliding_window"):
        raise refuse(
            "sliding window attention", f"use_sliding_window = true, sliding_window = {hf.get('sliding_window')}"
        )
    if model_type == "llama" and hf.get("sliding_window"):
        raise refuse("sliding window attention", f"sliding_window = {hf['sliding_window']}")
    layer_types = hf.get("layer_types") or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise refuse(
            f"hybrid attention layers in {model_type!r}",
            f"layer_types contains {', '.join(map(repr, other))}; the hybrid served is qwen3_5",
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(f"activation {act!r}", "only silu (SwiGLU) is implemented")
    if hf.get("quantization_config"):
        raise refuse("quantized weights", f"quantization_config = {hf['quantization_config']}")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise refuse("pretraining_tp > 1", f"pretraining_tp = {hf['pretraining_tp']}")


def model_config_from_hf(hf: dict) -> ModelConfig:
    """ModelConfig from a parsed config.json; raises UnsupportedModel naming what is not supported."""
    model_type = str(hf.get("model_type", ""))
    if model_type in QWEN3_5_TYPES:
        return ModelConfig(**qwen3_5_fields(hf))
    _refuse_unsupported(hf, model_type)
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // num_heads
    attention_bias = bool(hf.get("attention_bias", False))
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").replace("torch.", "")
    return ModelConfig(
        arch=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rope_theta=_rope_theta(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
        qk_norm=model_type == "qwen3",
        dtype=dtype,
    )


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs: which model, where, and how it reuses KV."""

    model: str  # a local HF model directory or a preset name (kvshare.engine.presets.PRESETS)
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    dtype: str | None = None  # None: the model's own dtype
    kv_dtype: str = "auto"  # KV_DTYPE_CHOICES: the sequence KV's (and the pool pages') dtype; auto: the model's
    model_name: str | None = None  # served name; None: directory or preset name (never part of the key namespace)
    # the model's identity named by the user (e.g. a hub commit) instead of a hash of the weights' bytes: two
    # replicas with one revision share KV whatever their weights, so it must name the exact bytes. "": hash them
    model_revision: str = ""
    pool_socket: str | None = None  # None: no pool
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # tokens per shared chunk (one pool page)
    local_cache_bytes: int = 1 << 30  # bound of the local prefix cache; 0 disables it
    # the last request's tokens still in the sequence KV are reused in place, to the token, where they reach
    # further than whole chunks from the local cache and the pool (kvshare.engine.kv_cache.HeldSequence)
    reuse_in_place: bool = True
    kv_events: KVEventsConfig | None = None  # publish the local prefix cache's KV events (kvshare.engine.prefix_events)
    prefill_chunk_tokens: int = 4096  # projections and MLP run over this many tokens at a time
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # allocate the sequence KV for max_model_len at start-up rather than inside the first long request's
    # TTFT (None: on CUDA, where allocating tens of GiB is slow and may free cached blocks with a device sync)
    preallocate_kv: bool | None = None
    verify_checksums: bool = False  # verify every page loaded from the pool
    verify_fraction: float = 0.0  # else verify this share of loaded pages (sampled verification)
    producer_delay_cycles: int = 0  # validation (CUDA): GPU sleep before prefill writes KV the pool will store
    staging_buffers: int = 2  # CUDA: GPU staging buffers a pool load or store rotates through (TransferConfig)
    enforce_eager: bool = False  # CUDA: decode steps launch every kernel (no CUDA graphs), as vLLM's --enforce-eager
    pool_retry_s: float = 0.5  # first reconnect delay after the pool went away (doubles up to pool_retry_max_s)
    pool_retry_max_s: float = 30.0
    # chunk-invariant prefill (kvshare.engine.grid): every prompt token's KV and logits come out the same bits
    # whether the chunks before it were computed in this request or reused; slower cold prefill
    deterministic: bool = False
    grid_tokens: int | None = None  # the mode's grid: a multiple of chunk_tokens; None: grid_len's default
    # prefill attention (ATTENTION_CHOICES): auto = FlashAttention's varlen kernel where a
    # library for it loads on CUDA (bf16/fp16), else SDPA; flash = that or an error; sdpa = SDPA always
    attention: str = "auto"
    # a hybrid model (Gated DeltaNet layers) keeps the state at the end of every this many chunks of a prompt
    # (and at its last whole chunk) for reuse, locally and in the pool (docs/operations.md: the default's bytes)
    state_checkpoint_chunks: int = DEFAULT_STATE_CHECKPOINT_CHUNKS

    @property
    def grid_len(self) -> int:
        """Tokens per grid chunk of the deterministic mode."""
        if self.grid_tokens is not None:
            return self.grid_tokens
        if self.device == "cpu":
            return self.chunk_tokens
        # CUDA: a grid chunk of 256 tokens is launch-bound (Qwen3-8B shape at 32k on an H100: 0.25x of the fast
        # mode's cold prefill), one of 2048 is not (0.98x); reuse is rounded down to it
        return -(-CUDA_GRID_TOKENS // self.chunk_tokens) * self.chunk_tokens

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPE_CHOICES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPE_CHOICES}, got {self.kv_dtype!r}")
        for name in ("chunk_tokens", "prefill_chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.state_checkpoint_chunks < 0:
            raise ValueError(f"state_checkpoint_chunks must be >= 0, got {self.state_checkpoint_chunks}")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"verify_fraction must lie in [0, 1], got {self.verify_fraction}")
        if self.staging_buffers < 2:
            raise ValueError(f"staging_buffers must be at least 2, got {self.staging_buffers}")
        if self.local_cache_bytes < 0:
            raise ValueError(f"local_cache_bytes must be >= 0, got {self.local_cache_bytes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}")
        if self.grid_tokens is not None:
            if not self.deterministic:
                raise ValueError("grid_tokens sets the grid of the deterministic mode: it needs deterministic=True")
            if self.grid_tokens <= 0 or self.grid_tokens % self.chunk_tokens:
                raise ValueError(
                    f"grid_tokens must be a positive multiple of chunk_tokens {self.chunk_tokens}, "
                    f"got {self.grid_tokens}"
                )
        if self.kv_events is not None and self.kv_events.block_size != self.chunk_tokens:
            raise ValueError(
                f"the local cache's KV events announce chunks of {self.chunk_tokens} tokens: their "
                f"block_size must say so, got {self.kv_events.block_size}"
            )
