"""The Qwen3.5 hybrid's configuration: published configs parse, the presets have the published shapes, and what
the engine lacks is refused by name."""

from __future__ import annotations

import pytest

from kvshare.engine.config import ModelConfig, UnsupportedModel, model_config_from_hf
from kvshare.engine.hybrid_config import state_layout_of
from kvshare.engine.presets import get_preset

TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
    "dtype": "bfloat16",
}
PUBLISHED = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": TEXT}


def test_a_published_nested_config_and_a_flat_text_config_parse_alike():
    nested, flat = model_config_from_hf({**PUBLISHED, "vision_config": {"depth": 27}}), model_config_from_hf(TEXT)
    assert nested == flat
    assert nested.arch == "qwen3_5" and nested.is_hybrid and nested.dtype == "bfloat16"
    assert nested.attention_layers == (3, 7) and nested.num_kv_layers == 2 and nested.num_linear_layers == 6
    assert nested.rotary_dim == 8 and nested.rope_theta == 1e7 and nested.qk_norm
    linear = nested.linear_attention
    assert (linear.num_key_heads, linear.num_value_heads, linear.conv_dim, linear.conv_kernel) == (2, 6, 160, 4)


def test_layer_types_default_to_every_fourth_layer_full_attention():
    config = model_config_from_hf({**TEXT, "full_attention_interval": 2})
    assert config.attention_layers == (1, 3, 5, 7)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "qwen3_5_moe"}, "mixture-of-experts"),
        ({"num_experts": 256}, "mixture-of-experts"),
        ({"mamba_ssm_dtype": "bfloat16"}, "recurrent state outside float32"),
        ({"layer_types": ["sliding_attention"] + ["full_attention"] * 7}, "'sliding_attention'"),
        ({"layer_types": ["linear_attention"] * 8}, "without full-attention layers"),
        ({"attn_output_gate": False}, "output gate"),
        ({"hidden_act": "gelu"}, "'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({"linear_num_value_heads": 5}, "not a multiple of its key heads"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized"),
    ],
)
def test_what_the_engine_lacks_is_refused_by_name(change, named):
    with pytest.raises(UnsupportedModel, match=named):
        model_config_from_hf({**PUBLISHED, "text_config": {**TEXT, **change}})


def test_the_moe_model_type_is_refused_before_its_text_config_is_read():
    with pytest.raises(UnsupportedModel, match="mixture-of-experts"):
        model_config_from_hf({"model_type": "qwen3_5_moe", "text_config": {}})


def test_the_27b_preset_has_qwen3_5_27bs_published_shape():
    c = get_preset("qwen3.5-27b").config
    assert (c.hidden_size, c.num_layers, c.intermediate_size, c.vocab_size) == (5120, 64, 17408, 248320)
    assert c.attention_layers == tuple(range(3, 64, 4))  # 16 x (3 GDN + 1 attention)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) == (24, 4, 256, 64)
    linear = c.linear_attention
    assert (linear.num_key_heads, linear.num_value_heads, linear.key_head_dim, linear.conv_kernel) == (16, 48, 128, 4)
    assert c.max_position_embeddings == 262144 and c.dtype == "bfloat16" and not c.tie_word_embeddings
    assert c.kv_bytes_per_token == 64 << 10  # 16 layers x (K, V) x 4 heads x 256 x 2 bytes
    assert state_layout_of(c).checkpoint_bytes == 153_944_064  # ~147 MiB: 48 x (3 MiB float32 + 60 KiB conv)


def test_the_9b_preset_has_qwen3_5_9bs_published_shape():
    c = get_preset("qwen3.5-9b").config
    assert (c.hidden_size, c.num_layers, c.intermediate_size, c.num_heads, c.num_kv_heads) == (4096, 32, 12288, 16, 4)
    assert c.num_kv_layers == 8 and c.linear_attention.num_value_heads == 32
    assert state_layout_of(c).checkpoint_bytes == 51_511_296


def test_an_attention_models_identity_has_no_hybrid_fields():
    """config_id (kvshare.keys.config_fingerprint of identity_fields) of the attention models stays what it was
    before the hybrid fields existed: their pool pages stay readable."""
    llama = get_preset("tiny").config
    assert not llama.is_hybrid and llama.num_kv_layers == llama.num_layers
    assert {"layer_types", "rotary_dim", "linear_attention"}.isdisjoint(llama.identity_fields())
    hybrid = get_preset("qwen3.5-tiny").config
    assert hybrid.identity_fields()["linear_attention"]["conv_kernel"] == 4


def test_linear_layers_need_the_hybrid_architecture():
    base = dict(get_preset("qwen3.5-tiny").config.__dict__)
    with pytest.raises(UnsupportedModel, match="qwen3_5"):
        ModelConfig(**{**base, "arch": "qwen3"})
