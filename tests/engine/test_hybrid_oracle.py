"""The Qwen3.5 hybrid against transformers' ``qwen3_5`` (the oracle): every layer's output and the float32 logits
agree within TOL on a tiny random config (3 Gated DeltaNet + 1 gated attention layer, twice), over cold
prefills, segmented GDN runs, suffixes resumed from a state, decode steps and greedy generation."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvshare.engine import hybrid_model
from kvshare.engine.hybrid_model import HybridLayer
from kvshare.engine.weights import load_model_dir
from tests.engine.conftest import VOCAB, write_hybrid_model

TOL = 1e-4  # float32 logits and hidden states (observed: ~1e-5)
# a decode step runs the delta rule's recurrent form where the reference's prefill runs its chunked form: the two
# round differently (observed: 1.04e-4 on logits of std 1.6)
STEP_TOL = 3e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers model, engine model, engine config, model directory)."""
    out = str(tmp_path_factory.mktemp("qwen3_5"))
    reference = write_hybrid_model(out)
    model, config, _fingerprint = load_model_dir(out, torch.device("cpu"))
    return reference, model, config, out


def _kv(config, capacity: int) -> torch.Tensor:
    # NaN-filled: a read of a position the forward did not write would poison the logits
    return torch.full((config.num_kv_layers, 2, config.num_kv_heads, capacity, config.head_dim), float("nan"))


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _reference(reference, ids: torch.Tensor):
    with torch.no_grad():
        return reference(ids[None], output_hidden_states=True)


def test_the_config_is_the_hybrid_the_reference_builds(pair):
    reference, _model, config, _ = pair
    assert config.is_hybrid and config.layer_types == tuple(reference.config.layer_types)
    assert config.attention_layers == (3, 7) and config.num_kv_layers == 2 and config.rotary_dim == 8


def test_every_layers_output_matches_transformers(pair, monkeypatch):
    """Hidden states after each layer (one GDN segment per layer: chunk_tokens covers the prompt)."""
    reference, model, config, _ = pair
    ids = _ids(70, 1)
    outputs = []
    linear_step, attention_layer = HybridLayer.linear_step, hybrid_model.attention_layer
    monkeypatch.setattr(HybridLayer, "linear_step", lambda *a, **k: _kept(outputs, linear_step(*a, **k)))
    monkeypatch.setattr(hybrid_model, "attention_layer", lambda *a, **k: _kept(outputs, attention_layer(*a, **k)))
    expected = _reference(reference, ids)
    with torch.inference_mode():
        got = model(ids, _kv(config, 80), 0, all_logits=True)
    assert len(outputs) == config.num_layers
    hidden = expected.hidden_states[1:]  # after each layer (the last one after the final norm)
    for layer, (ours, theirs) in enumerate(zip(outputs[:-1], hidden[:-1])):
        assert (ours - theirs[0]).abs().max().item() < TOL, f"layer {layer}"
    assert (model.model.norm(outputs[-1]) - hidden[-1][0]).abs().max().item() < TOL
    assert (got - expected.logits[0]).abs().max().item() < TOL
    assert expected.logits.std() > 0.5  # the logits vary: the comparison means something


def _kept(outputs: list, x: torch.Tensor) -> torch.Tensor:
    outputs.append(x.clone())
    return x


def test_segmented_gdn_and_chunked_projections_match(pair):
    """GDN layers run their tokens in segments carrying the state (here 7 tokens each, cut at 19 and 40 too)."""
    reference, model, config, _ = pair
    ids = _ids(48, 2)
    expected = _reference(reference, ids).logits[0]
    state = model.state
    cuts = {p: state.empty_checkpoint(p) for p in (19, 40)}
    with torch.inference_mode():
        chunked = model(ids, _kv(config, 48), 0, chunk_tokens=7, all_logits=True, checkpoints=cuts)
    assert (chunked - expected).abs().max().item() < TOL
    assert all(c.data.abs().sum() > 0 for c in cuts.values())  # every layer's state was copied in


def test_a_suffix_resumed_from_a_state_and_decode_steps_match_full_recompute(pair):
    reference, model, config, _ = pair
    ids = _ids(40, 3)
    expected = _reference(reference, ids).logits[0]
    kv = _kv(config, 64)
    with torch.inference_mode():
        model(ids[:20], kv, 0)  # the prefix: KV and the GDN state at 20
        suffix = model(ids[20:33], kv, 20, all_logits=True)  # 13 queries over 33 keys, from the state at 20
        steps = [model(ids[i : i + 1], kv, i) for i in range(33, 40)]  # the recurrent step, one token at a time
    assert (suffix - expected[20:33]).abs().max().item() < TOL
    assert (torch.cat(steps) - expected[33:40]).abs().max().item() < STEP_TOL


def test_a_checkpoint_restores_the_state_of_its_position(pair):
    """The state after 16 tokens, kept while a longer prefill ran on, resumes a prefill from 16."""
    reference, model, config, _ = pair
    ids = _ids(40, 4)
    expected = _reference(reference, ids).logits[0]
    kv = _kv(config, 48)
    at = {16: model.state.empty_checkpoint(16)}
    with torch.inference_mode():
        model(ids[:30], kv, 0, checkpoints=at)
        with pytest.raises(ValueError, match="holds the first 30 tokens"):
            model(ids[16:], kv, 16)  # the live state is at 30: never combined with the KV of 16
        model.state.restore(at[16])
        resumed = model(ids[16:], kv, 16, all_logits=True)
    assert (resumed - expected[16:]).abs().max().item() < TOL


def test_greedy_tokens_equal_transformers_generate(pair):
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, RequestOptions, SamplingParams

    reference, _model, _config, out = pair
    ids = _ids(90, 5)
    with torch.no_grad():
        want = reference.generate(ids[None], max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, 90:]
    engine = Engine(EngineConfig(model=out, chunk_tokens=32))
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        got = [e.token_id for e in engine.generate(ids.tolist(), params, RequestOptions())]
    finally:
        engine.close()
    assert got == want.tolist()


def test_a_published_checkpoints_vision_tower_and_mtp_head_are_not_loaded(pair, tmp_path):
    """Text only: model.visual.* and mtp.* tensors in the file are skipped; the decoder loads as before."""
    from safetensors.torch import load_file, save_file

    _reference_model, model, config, out = pair
    state = load_file(os.path.join(out, "model.safetensors"))
    state["model.visual.patch_embed.proj.weight"] = torch.ones(4, 3)
    state["mtp.layers.0.mlp.up_proj.weight"] = torch.ones(2, 2)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        hf = json.load(f)
    hf["vision_config"] = {"depth": 1, "hidden_size": 4}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded, _, _ = load_model_dir(str(tmp_path), torch.device("cpu"))
    ids = _ids(20, 6)
    with torch.inference_mode():
        a = loaded(ids, _kv(config, 20), 0)
        b = model(ids, _kv(config, 20), 0)
    assert (a - b).abs().max().item() < TOL  # not bitwise: the GEMMs see other alignments in another file
