"""The hybrid model the vLLM suite runs: a tiny Qwen3-Next (Gated DeltaNet + gated attention) with random weights.

vLLM CPU runs this family's GDN layers only in bf16 and with head dims its kernels know (128), and vLLM's Qwen3.5
module imports its vision model (torchvision, absent from the vLLM CPU environment), so the tests use the text-only
Qwen3-Next architecture of the same layer pattern (tests/hybrid_layers.py: 8 layers, 2 x (3 GDN + 1 gated attention),
2 key / 4 value GDN heads, 4 query / 2 KV attention heads) with GDN heads of 128 and attention heads of 64, dense MLPs
but the last layer's (Qwen3-Next needs one MoE layer), the byte tokenizer of the tiny preset. vLLM gives it blocks of
640 tokens on CPU.
"""

from __future__ import annotations

import os
import shutil

from tests.hybrid_layers import TINY_HYBRID_LAYERS
from tests.integrations.vllm.tiny_model import VOCAB_SIZE, make_model_dir

NUM_LAYERS = TINY_HYBRID_LAYERS["num_hidden_layers"]
TEXT_CONFIG = dict(
    TINY_HYBRID_LAYERS,
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    intermediate_size=768,
    head_dim=64,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    decoder_sparse_step=1,
    mlp_only_layers=list(range(NUM_LAYERS - 1)),
    max_position_embeddings=32768,
    partial_rotary_factor=0.25,
    tie_word_embeddings=False,
    bos_token_id=256,
    eos_token_id=257,
)
HEAD_GAIN = 8.0  # the output head scaled up: greedy tokens with clear margins, not ties of a near-uniform softmax


def make_hybrid_model_dir(path: str, seed: int = 0) -> str:
    """Write the tiny hybrid (bf16 weights, transformers' random init with ``seed``) to ``path`` once."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**TEXT_CONFIG, torch_dtype="bfloat16"))
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_GAIN)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    tokenizer = make_model_dir(path + "-tokenizer")  # the tiny preset's byte tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(tokenizer, name), path)
    return path
