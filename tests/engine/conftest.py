"""Fixtures of the engine tests: a tiny preset directory, small random HF models, a pool."""

from __future__ import annotations

import os

import pytest
import torch

from kvshare.engine.tokenizer import build_byte_tokenizer, byte_tokenizer_config
from tests.hybrid_layers import TINY_HYBRID_LAYERS

VOCAB = 260
# small shapes of each architecture; GQA everywhere, head_dim decoupled from hidden/heads in qwen3
HF_CONFIGS = {
    "llama": dict(model_type="llama", attention_bias=False),
    "llama_bias_tied": dict(model_type="llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "qwen3_tied": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
}


def write_hf_model(kind: str, out_dir: str, seed: int = 0):
    """A random transformers model of ``kind`` saved with save_pretrained (+ the byte tokenizer); returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(HF_CONFIGS[kind])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        rope_theta=10000.0,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: randomise them so their use is tested
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_byte_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    import json

    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(byte_tokenizer_config(512), f)
    return model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """The tiny preset written by make-model (once per test session)."""
    from kvshare.engine.make_model import write_model_dir

    out = str(tmp_path_factory.mktemp("models") / "tiny")
    write_model_dir("tiny", out)
    return out


@pytest.fixture
def pool_socket():
    """A fresh pool that keeps every committed page (no watermark eviction)."""
    from kvshare.pool.spawn import running_pool

    with running_pool(
        "64MiB", ("--extent-size", "8MiB", "--high-watermark", "1", "--low-watermark", "1"), quiet=True
    ) as path:
        yield path


def ascii_prompt(num_tokens: int, seed: int = 0) -> str:
    """num_tokens printable ASCII characters (one byte-level token each)."""
    g = torch.Generator().manual_seed(seed)
    return "".join(chr(int(c)) for c in torch.randint(32, 127, (num_tokens,), generator=g))


def write_hybrid_model(out_dir: str, seed: int = 0, **overrides):
    """A random transformers Qwen3.5 hybrid (TINY_HYBRID_LAYERS: 3 Gated DeltaNet + 1 attention layer, twice) saved
    as a published checkpoint is (model_type qwen3_5 with a text_config, weights under model.language_model.), with
    the byte tokenizer; returns the transformers model (Qwen3_5ForCausalLM, float32, eval)."""
    import json

    from safetensors.torch import save_file
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    spec = dict(
        TINY_HYBRID_LAYERS,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        head_dim=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    config = Qwen3_5TextConfig(**{**spec, **overrides})
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).float().eval()
    with torch.no_grad():  # norms start at 0 (a scale of 1) and dt_bias at 1: randomise them so their use is tested
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                param.add_(torch.randn_like(param) * 0.3)
            if name.endswith("A_log"):  # decays from long (A = 0.01) to short (A = 2) memory
                param.copy_(torch.linspace(0.01, 2.0, param.numel()).log())
    os.makedirs(out_dir, exist_ok=True)
    text = json.loads(config.to_json_string())
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5", "text_config": text}, f)
    state = {
        ("model.language_model." + n[len("model.") :] if n.startswith("model.") else n): t.contiguous()
        for n, t in model.state_dict().items()
    }
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    build_byte_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(byte_tokenizer_config(512), f)
    return model
