"""The Qwen3.5 presets' configs, as data (the init of the tensors only a hybrid has: kvshare.engine.presets).

``qwen3.5-27b`` has exactly Qwen/Qwen3.5-27B's text config (the same in Qwen3.6-27B): 64 layers of 5120,
16 x (3 Gated DeltaNet + 1 gated attention), attention 24 query / 4 KV heads of 256 with RoPE on 64 dims
(theta 1e7), GDN 16 key / 48 value heads of 128 with a conv of 4, MLP 17408, vocabulary 248320, 262144
positions, untied, bfloat16. ``qwen3.5-9b`` has Qwen/Qwen3.5-9B's text config: 32 layers of 4096 (8 x (3 + 1)),
attention 16 / 4 heads of 256, GDN 16 / 32 heads of 128, MLP 12288, the same vocabulary, RoPE and context
(transformers' Qwen3_5TextConfig defaults are this model's, its context aside); in bf16 about 17 GiB of
weights, so two replicas and their KV fit one 80 GiB GPU. ``qwen3.5-tiny`` is a small shape of the same
layout for CPU tests and the demo (2 x (3 + 1) layers, the byte tokenizer).

Directories are written as published checkpoints are: ``model_type: qwen3_5`` with the decoder's config in
``text_config`` (``model_type: qwen3_5_text``), which transformers' AutoModelForCausalLM loads as
``Qwen3_5ForCausalLM`` (kvshare.engine.architectures names the weights).
"""

from __future__ import annotations

from kvshare.engine.tokenizer import BOS_ID, EOS_ID

QWEN3_5_ROPE_THETA = 10_000_000.0
QWEN3_5_VOCAB = 248320
QWEN3_5_CONTEXT = 262144
# the spread of the GDN heads' decay rates A = exp(A_log): from 1e-3 (long memory) to 1 (a few tokens)
A_MIN_LOG10, A_MAX_LOG10 = -3.0, 0.0


def qwen3_5_config(*, num_layers: int, dtype: str, **text) -> dict:
    """A Qwen3.5 config.json: the outer config and its ``text_config`` (every fourth layer full attention)."""
    text_config = {
        "model_type": "qwen3_5_text",
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "head_dim": 256,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_cache": True,
        "num_hidden_layers": num_layers,
        "full_attention_interval": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": QWEN3_5_CONTEXT,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": QWEN3_5_ROPE_THETA,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "vocab_size": QWEN3_5_VOCAB,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "dtype": dtype,
        **text,
    }
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "tie_word_embeddings": text_config["tie_word_embeddings"],
        "dtype": dtype,
    }


def with_dtype(hf: dict, dtype: str) -> dict:
    """``hf`` with its dtype set to ``dtype`` (in ``text_config`` too where it nests one)."""
    out = {**hf, "dtype": dtype}
    if isinstance(hf.get("text_config"), dict):
        out["text_config"] = {**hf["text_config"], "dtype": dtype}
    return out
