"""The synthetic presets as data: each preset's config.json, seed, init gains and tokenizer (no torch).

``tiny`` is the CPU model of tests, the demo and vLLM CPU runs; ``qwen3-8b`` and ``qwen3-32b`` have exactly the
shapes of those models for GPU benchmarks. ``tiny`` keeps the 260-token byte tokenizer (its vocabulary is 260);
the Qwen3 shapes carry the 131072-token BPE of kvshare.engine.bpe, so a text prompt costs what it does with a
real checkpoint. Contexts: ``qwen3-8b`` takes 262144 positions (the study's 256k: 36 GiB of KV), ``qwen3-32b``
131072 (its 128k: 32 GiB; at 256k its KV alone would be 64 GiB beside 61 GiB of weights). On CUDA a replica
allocates the KV of its whole context at start-up, so pass ``--max-model-len`` to run the 8B shape in less
memory. How a preset's weights are drawn is kvshare.engine.presets; a process that builds no model (the router,
for a preset's tokenizer) reads only this table.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kvshare.engine.config import ModelConfig, model_config_from_hf
from kvshare.engine.hybrid_presets import qwen3_5_config, with_dtype
from kvshare.engine.tokenizer import BOS_ID, EOS_ID
from kvshare.errors import UserError


@dataclass(frozen=True)
class Preset:
    name: str
    hf_config: dict  # the config.json a directory of this preset carries (dtype aside)
    seed: int
    embed_std: float  # std of the embedding (and tied head) entries
    linear_gain: float  # std of a projection entry = gain / sqrt(fan_in)
    head_gain: float  # the same for an untied LM head
    draw_on_device: bool  # False: drawn on the CPU (same weights on every device); True: on the target device (fast)
    # the model's parameters (a tied head counted once): what its weights take, known without building it;
    # tests/engine/test_presets.py counts them in the built model
    num_parameters: int
    # "byte" (260 tokens), "bpe" (131072) or "bpe248k" (248320, kvshare.engine.bpe): what text costs
    tokenizer: str = "byte"

    @property
    def config(self) -> ModelConfig:
        return model_config_from_hf(self.hf_config)


def _llama_config(**kw) -> dict:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pretraining_tp": 1,
    }
    return {**base, **kw}


def _qwen3_config(**kw) -> dict:
    base = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "vocab_size": 151936,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_cache": True,
        "max_position_embeddings": 131072,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    return {**base, **kw}


def _rope(theta: float) -> dict:
    return {"rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}


# tiny: gain 2 makes a small model's greedy continuations depend on the whole context (tests need that).
# qwen3-*: gain 1 and a sharper head (median top-1 probability ~0.5 on the H200) keep bf16 rounding noise
# (|d logprob| of the top token ~0.01-0.03 between a cold prefill and a suffix over reused KV) well below
# typical top-2 gaps (~1), so reuse/recompute comparisons diverge rarely.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "tiny",
        _llama_config(
            vocab_size=260,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=32768,
            dtype="float32",
            **_rope(1e6),
        ),
        seed=20261129,
        embed_std=1.0,
        linear_gain=2.0,
        head_gain=4.0,
        draw_on_device=False,
        num_parameters=8_001_792,
    ),
    "qwen3-8b": Preset(
        "qwen3-8b",
        _qwen3_config(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            max_position_embeddings=262144,
            dtype="bfloat16",
            **_rope(1e6),
        ),
        seed=8,
        embed_std=1.0,
        linear_gain=1.0,
        head_gain=8.0,
        draw_on_device=True,
        num_parameters=8_190_735_360,
        tokenizer="bpe",
    ),
    "qwen3-32b": Preset(
        "qwen3-32b",
        _qwen3_config(
            hidden_size=5120,
            intermediate_size=25600,
            num_hidden_layers=64,
            num_attention_heads=64,
            dtype="bfloat16",
            **_rope(1e6),
        ),
        seed=32,
        embed_std=1.0,
        linear_gain=1.0,
        head_gain=8.0,
        draw_on_device=True,
        num_parameters=32_762_123_264,
        tokenizer="bpe",
    ),
    # the Qwen3.5 dense hybrid (kvshare.engine.hybrid_presets: shapes and their sources)
    "qwen3.5-tiny": Preset(
        "qwen3.5-tiny",
        qwen3_5_config(
            num_layers=8,
            dtype="float32",
            vocab_size=260,
            hidden_size=256,
            intermediate_size=768,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            max_position_embeddings=32768,
        ),
        seed=20261207,
        embed_std=1.0,
        linear_gain=2.0,
        head_gain=4.0,
        draw_on_device=False,
        num_parameters=6_185_712,
    ),
    "qwen3.5-9b": Preset(
        "qwen3.5-9b",
        qwen3_5_config(
            num_layers=32,
            dtype="bfloat16",
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=16,
            num_key_value_heads=4,
            linear_num_value_heads=32,
        ),
        seed=9,
        embed_std=1.0,
        linear_gain=1.0,
        head_gain=8.0,
        draw_on_device=True,
        num_parameters=8_953_803_264,
        tokenizer="bpe248k",
    ),
    "qwen3.5-27b": Preset(
        "qwen3.5-27b",
        qwen3_5_config(
            num_layers=64,
            dtype="bfloat16",
            hidden_size=5120,
            intermediate_size=17408,
            num_attention_heads=24,
            num_key_value_heads=4,
            linear_num_value_heads=48,
        ),
        seed=27,
        embed_std=1.0,
        linear_gain=1.0,
        head_gain=8.0,
        draw_on_device=True,
        num_parameters=26_895_998_464,
        tokenizer="bpe248k",
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def model_config_of(model: str) -> ModelConfig:
    """The config of a model directory (its config.json) or of a preset, without loading any weights."""
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return model_config_from_hf(json.load(f))
    return get_preset(model).config


def preset_hf_config(preset: Preset, dtype: str | None = None) -> dict:
    hf = dict(preset.hf_config) if dtype is None else with_dtype(preset.hf_config, dtype)
    hf["kvshare_preset"] = preset.name
    return hf
