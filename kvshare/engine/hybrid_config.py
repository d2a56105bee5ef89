"""The Qwen3.5 / 3.6 dense hybrid's configuration: Gated DeltaNet layers between gated full-attention layers.

A published checkpoint's ``config.json`` has ``model_type: qwen3_5`` and nests the decoder in ``text_config``
(``model_type: qwen3_5_text``; a text-only save of transformers' ``Qwen3_5ForCausalLM`` writes that flat). Of
Qwen3.5-27B's 64 layers every fourth is full attention and the other 48 are linear attention::

    layer_types   GDN GDN GDN ATT | GDN GDN GDN ATT | ... (16 x)      full_attention_interval 4
    attention     24 query / 4 KV heads of 256, q/k RMSNorm, RoPE on the first 64 dims (partial_rotary_factor
                  0.25), a sigmoid gate per query dim from q_proj's second half
    GDN           16 key / 48 value heads of 128; causal conv (kernel 4) over the mixed q/k/v; L2-normalised
                  q/k; decay g = -exp(A_log) * softplus(a + dt_bias), strength beta = sigmoid(b); the
                  recurrent state [value head, key dim, value dim] in float32 (``mamba_ssm_dtype``)

The engine serves the text decoder only: a vision tower (``vision_config``, ``model.visual.*``) and the
multi-token-prediction head (``mtp.*``) are not loaded. The mixture-of-experts variants (``qwen3_5_moe``) are
refused by name. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.engine.unsupported import refuse
from kvshare.state_layout import StateLayout

QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text")
QWEN3_5_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
RECURRENT_STATE_DTYPE = "float32"
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Shapes of a Gated DeltaNet layer (transformers' ``Qwen3_5GatedDeltaNet``)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    state_dtype: str = RECURRENT_STATE_DTYPE  # the recurrent state's dtype (mamba_ssm_dtype)

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LinearAttentionConfig.{name} must be positive, got {getattr(self, name)}")
        if self.conv_kernel < 2:
            raise ValueError(f"LinearAttentionConfig.conv_kernel must be at least 2, got {self.conv_kernel}")
        if self.num_value_heads % self.num_key_heads:
            raise refuse(
                "Gated DeltaNet value heads that are not a multiple of its key heads",
                f"{self.num_value_heads} value heads, {self.num_key_heads} key heads",
            )
        if self.state_dtype != RECURRENT_STATE_DTYPE:
            raise refuse("a Gated DeltaNet recurrent state outside float32", f"mamba_ssm_dtype = {self.state_dtype}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: the mixed q, k and v."""
        return 2 * self.key_dim + self.value_dim


def text_config(hf: dict) -> dict:
    """The decoder's configuration: ``text_config`` where the checkpoint nests it (its dtype and tying from the
    outer config where the inner one leaves them out), else the config itself."""
    inner = hf.get("text_config")
    if not isinstance(inner, dict):
        return hf
    text = dict(inner)
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if key not in text and key in hf:
            text[key] = hf[key]
    return text


def qwen3_5_fields(hf: dict) -> dict:
    """kvshare.engine.config.ModelConfig's fields of a Qwen3.5 config.json; refuses what the engine lacks by name."""
    model_type = str(hf.get("model_type", ""))
    text = text_config(hf)
    _refuse_unsupported(text, model_type)
    num_heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // num_heads)
    attention_bias = bool(text.get("attention_bias", False))
    return dict(
        arch="qwen3_5",
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_layers=int(text["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rope_theta=_rope_theta(text),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        qk_norm=True,
        dtype=str(text.get("dtype") or text.get("torch_dtype") or "float32").replace("torch.", ""),
        layer_types=_layer_types(text),
        rotary_dim=_rotary_dim(text, head_dim),
        linear_attention=LinearAttentionConfig(
            num_key_heads=int(text.get("linear_num_key_heads", 16)),
            num_value_heads=int(text.get("linear_num_value_heads", 32)),
            key_head_dim=int(text.get("linear_key_head_dim", 128)),
            value_head_dim=int(text.get("linear_value_head_dim", 128)),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            state_dtype=str(text.get("mamba_ssm_dtype") or RECURRENT_STATE_DTYPE).replace("torch.", ""),
        ),
    )


def _refuse_unsupported(text: dict, model_type: str) -> None:
    if model_type in QWEN3_5_MOE_TYPES or str(text.get("model_type", "")) in QWEN3_5_MOE_TYPES:
        raise refuse("mixture-of-experts layers (MoE)", f"model_type = {model_type!r}")
    for key in _MOE_KEYS:
        if text.get(key):
            raise refuse("mixture-of-experts layers (MoE)", f"{key} = {text[key]}")
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(f"activation {act!r}", "only silu (SwiGLU, and the GDN's conv) is implemented")
    if text.get("quantization_config"):
        raise refuse("quantized weights", f"quantization_config = {text['quantization_config']}")
    if text.get("attn_output_gate") is False:
        raise refuse("Qwen3.5 attention without its output gate", "attn_output_gate = false")


def _layer_types(text: dict) -> tuple[str, ...]:
    """Each layer's kind, from ``layer_types`` or else ``full_attention_interval`` (transformers' default: 4)."""
    num_layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types")
    if not layer_types:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    other = sorted({t for t in layer_types if t not in (FULL_ATTENTION, LINEAR_ATTENTION)})
    if other:
        raise refuse("these layer kinds", f"layer_types contains {', '.join(map(repr, other))}")
    if len(layer_types) != num_layers:
        raise refuse("a layer_types list of another length", f"{len(layer_types)} entries for {num_layers} layers")
    if FULL_ATTENTION not in layer_types:
        raise refuse("a hybrid model without full-attention layers", "layer_types holds linear_attention only")
    return tuple(layer_types)


def _rope_theta(text: dict) -> float:
    """RoPE's base. Text positions are equal on M-RoPE's three axes, where interleaved M-RoPE is the default RoPE,
    so ``mrope_section`` is accepted; every scaling variant is refused."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (None, "default"):
        raise refuse(f"rope scaling variant {kind!r}", f"rope_parameters = {params}")
    return float(params.get("rope_theta", text.get("rope_theta", 10000.0)))


def _rotary_dim(text: dict, head_dim: int) -> int:
    """Dims of each head that RoPE rotates: int(head_dim * partial_rotary_factor) (transformers' default 0.25)."""
    params = text.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    rotary = int(head_dim * factor)
    if rotary <= 0 or rotary % 2 or rotary > head_dim:
        raise refuse("this partial rotary factor", f"partial_rotary_factor = {factor} of head_dim {head_dim}")
    return rotary


def state_layout_of(config) -> StateLayout:
    """The checkpoint layout of a hybrid ModelConfig (kvshare.engine.config): its conv state in the model's dtype."""
    linear = config.linear_attention
    return StateLayout(
        num_layers=config.num_linear_layers,
        num_value_heads=linear.num_value_heads,
        key_head_dim=linear.key_head_dim,
        value_head_dim=linear.value_head_dim,
        conv_dim=linear.conv_dim,
        conv_kernel=linear.conv_kernel,
        recurrent_dtype=linear.state_dtype,
        conv_dtype=config.dtype,
    )
