"""Configurations the engine cannot run are refused by name, before any weight is read."""

from __future__ import annotations

import pytest

from kvshare.engine.config import EngineConfig, UnsupportedModel, model_config_from_hf

BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "'llama3'"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, "sliding window"),
        ({"sliding_window": 4096}, "sliding window"),
        ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "'sliding_attention'"),
        ({"model_type": "qwen3", "layer_types": ["linear_attention", "full_attention"]}, "hybrid attention"),
        ({"model_type": "qwen3_moe", "num_experts": 8}, "'qwen3_moe'"),
        ({"model_type": "qwen3", "num_experts": 8}, "mixture-of-experts"),
        ({"model_type": "mixtral"}, "'mixtral'"),
        ({"hidden_act": "gelu"}, "'gelu'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantized"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
    ],
)
def test_unsupported_features_are_refused_by_name(extra, named):
    with pytest.raises(UnsupportedModel, match=named.replace("(", r"\(")):
        model_config_from_hf({**BASE, **extra})


def test_supported_variants_parse():
    llama = model_config_from_hf(
        {**BASE, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    )
    assert (llama.arch, llama.head_dim, llama.rope_theta, llama.qk_norm, llama.qkv_bias) == (
        "llama",
        16,
        5e5,
        False,
        False,
    )
    qwen2 = model_config_from_hf({**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False})
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)
    qwen3 = model_config_from_hf(
        {**BASE, "model_type": "qwen3", "head_dim": 128, "layer_types": ["full_attention"] * 2}
    )
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.qkv_bias) == (True, 128, False)


def test_engine_config_is_validated():
    with pytest.raises(ValueError, match="chunk_tokens"):
        EngineConfig(model="tiny", chunk_tokens=0)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model="tiny", device="tpu")
