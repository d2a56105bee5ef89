"""Presets: fixed seeds, exact shapes, varied outputs, and make-model directories other engines load."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, SamplingParams
from kvshare.engine.make_model import preset_weight_bytes, write_model_dir
from kvshare.engine.model import Transformer
from kvshare.engine.presets import PRESETS, build_preset, get_preset, preset_tensors
from kvshare.engine.tokenizer import CHAT_TEMPLATE, render_chat
from kvshare.engine.weights import model_dir_fingerprint

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def _file_digests(path: str) -> dict[str, str]:
    return {n: hashlib.sha256(open(os.path.join(path, n), "rb").read()).hexdigest() for n in sorted(os.listdir(path))}


def test_same_preset_same_weights_bitwise(tiny_dir, tmp_path):
    a, _, fa = build_preset("tiny", torch.device("cpu"))
    b, _, fb = build_preset("tiny", torch.device("cpu"))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert fa == fb
    again = str(tmp_path / "again")
    assert write_model_dir("tiny", again) == model_dir_fingerprint(tiny_dir)
    assert _file_digests(again) == _file_digests(tiny_dir)


def test_tiny_preset_shape():
    c = get_preset("tiny").config
    assert c.arch == "llama" and c.num_layers >= 4 and c.head_dim == 64 and c.num_kv_heads == 2
    assert c.max_position_embeddings >= 16384 and c.dtype == "float32"


@pytest.mark.parametrize(
    ("name", "layers", "hidden", "inter", "billions"),
    [
        ("qwen3-8b", 36, 4096, 12288, 8.19),
        ("qwen3-32b", 64, 5120, 25600, 32.76),
    ],
)
def test_qwen3_preset_shapes(name, layers, hidden, inter, billions):
    c = get_preset(name).config
    assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size) == ("qwen3", layers, hidden, inter)
    assert (c.num_kv_heads, c.head_dim, c.vocab_size, c.qk_norm, c.dtype) == (8, 128, 151936, True, "bfloat16")
    with torch.device("meta"):
        model = Transformer(c)
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - billions) < 0.01
    assert preset_weight_bytes(name) > 16 << 30 if name == "qwen3-32b" else True


def test_tiny_outputs_are_varied():
    """20 prompts: >= 15 distinct greedy continuations; changing the first token changes >= 80% of them."""
    engine = Engine(EngineConfig(model="tiny", local_cache_bytes=0))
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def continuation(ids):
        return tuple(e.token_id for e in engine.generate(ids, params))

    prompts = [engine.tokenizer.encode(f"Request {i}: tell me about item number {i * 37 % 101}.") for i in range(20)]
    outputs = [continuation(p) for p in prompts]
    changed = sum(continuation([(p[0] + 1) % 256] + p[1:]) != out for p, out in zip(prompts, outputs))
    assert len(set(outputs)) >= 15
    assert changed >= 16


def test_make_model_dir_loads_in_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == render_chat(CHAT_TEMPLATE, MESSAGES, add_generation_prompt=True)  # plain jinja2 agrees
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )
    engine = Engine(EngineConfig(model=tiny_dir))
    ids = engine.tokenizer.apply_chat_template(MESSAGES)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(engine.tokenizer.encode("exactly 20 characters"[:20])) == 20
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    kv = torch.zeros(8, 2, 2, len(ids), 64)
    with torch.inference_mode():
        got = engine.model(torch.tensor(ids), kv, 0, all_logits=True)
    assert (got - expected).abs().max().item() < 1e-4
    # a directory is named by its bytes, the preset built in memory by its recipe
    assert engine.namespace.weights_fingerprint == model_dir_fingerprint(tiny_dir)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_presets_recorded_parameters_are_its_models(name):
    """The table's num_parameters (what memory checks read without torch) is what the built model holds."""
    from kvshare.engine.architectures import new_model

    preset = PRESETS[name]
    with torch.device("meta"):
        model = new_model(preset.config)
    assert preset.num_parameters == sum(t.numel() for _, t in preset_tensors(model))
