"""The Qwen3.5 presets: make-model writes a published checkpoint's layout that transformers loads, the same
bytes every time, weights that make varied outputs; the large shapes' parameter counts."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from kvshare.engine.architectures import new_model
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, SamplingParams
from kvshare.engine.make_model import write_model_dir
from kvshare.engine.presets import build_preset, get_preset
from kvshare.engine.weights import model_dir_fingerprint

TOL = 1e-4  # float32 logits against transformers' qwen3_5


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("models") / "qwen3.5-tiny")
    write_model_dir("qwen3.5-tiny", out)
    return out


def _digests(path: str) -> dict[str, str]:
    return {n: hashlib.sha256(open(os.path.join(path, n), "rb").read()).hexdigest() for n in sorted(os.listdir(path))}


def test_make_model_writes_a_published_checkpoints_layout_the_same_every_time(hybrid_dir, tmp_path):
    with open(os.path.join(hybrid_dir, "config.json")) as f:
        hf = json.load(f)
    assert hf["model_type"] == "qwen3_5" and hf["text_config"]["model_type"] == "qwen3_5_text"
    from safetensors import safe_open

    with safe_open(os.path.join(hybrid_dir, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.language_model.layers.0.linear_attn.A_log" in names and "lm_head.weight" in names
    assert not any(n.startswith("model.layers.") for n in names)
    again = str(tmp_path / "again")
    assert write_model_dir("qwen3.5-tiny", again) == model_dir_fingerprint(hybrid_dir)
    assert _digests(again) == _digests(hybrid_dir)


def test_transformers_loads_the_directory_and_computes_the_same_logits(hybrid_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(hybrid_dir).eval()
    assert type(reference).__name__ == "Qwen3_5ForCausalLM"
    model, config, _ = build_preset("qwen3.5-tiny", torch.device("cpu"))
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    kv = torch.zeros(config.num_kv_layers, 2, config.num_kv_heads, 150, config.head_dim)
    with torch.inference_mode():
        got = model(ids, kv, 0, all_logits=True)
    assert (got - expected).abs().max().item() < TOL
    assert expected.std() > 0.5


def test_the_tiny_hybrids_outputs_are_varied():
    """12 prompts: >= 10 distinct greedy continuations; changing the first token changes >= 9 of them."""
    engine = Engine(EngineConfig(model="qwen3.5-tiny", local_cache_bytes=0))
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def continuation(ids):
        return tuple(e.token_id for e in engine.generate(ids, params))

    prompts = [engine.tokenizer.encode(f"Request {i}: tell me about item number {i * 37 % 101}.") for i in range(12)]
    outputs = [continuation(p) for p in prompts]
    changed = sum(continuation([(p[0] + 1) % 256] + p[1:]) != out for p, out in zip(prompts, outputs))
    engine.close()
    assert len(set(outputs)) >= 10
    assert changed >= 9


@pytest.mark.parametrize(("name", "billions"), [("qwen3.5-9b", 8.95), ("qwen3.5-27b", 26.90)])
def test_the_large_shapes_parameter_counts(name, billions):
    """The text decoder's parameters (a published checkpoint adds its vision tower and MTP head)."""
    with torch.device("meta"):
        model = new_model(get_preset(name).config)
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - billions) < 0.01
