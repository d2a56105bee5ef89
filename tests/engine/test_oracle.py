"""The plain-torch decoder against transformers (the oracle): float32 logits, suffix and decode paths."""

from __future__ import annotations

import pytest
import torch

from kvshare.engine.weights import load_model_dir
from tests.engine.conftest import HF_CONFIGS, VOCAB, write_hf_model

TOL = 1e-4


def _kv(config, capacity: int) -> torch.Tensor:
    # NaN-filled: a read of a position the forward did not write would poison the logits
    return torch.full((config.num_layers, 2, config.num_kv_heads, capacity, config.head_dim), float("nan"))


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, engine model, engine config) for one architecture variant."""
    out = str(tmp_path_factory.mktemp(request.param))
    reference = write_hf_model(request.param, out)
    model, config, _fingerprint = load_model_dir(out, torch.device("cpu"))
    return reference, model, config


def _reference_logits(reference, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(ids[None]).logits[0].float()  # [T, V]


def test_full_prefill_matches_transformers(pair):
    reference, model, config = pair
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    expected = _reference_logits(reference, ids)
    with torch.inference_mode():
        got = model(ids, _kv(config, 64), 0, all_logits=True)
    assert (got - expected).abs().max().item() < TOL
    assert expected.std() > 0.1  # the logits vary: the comparison means something


def test_chunked_projections_match(pair):
    _reference, model, config = pair
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        whole = model(ids, _kv(config, 48), 0, all_logits=True)
        chunked = model(ids, _kv(config, 48), 0, chunk_tokens=7, all_logits=True)
    assert (whole - chunked).abs().max().item() < TOL


def test_suffix_over_prefix_and_decode_match_full_recompute(pair):
    reference, model, config = pair
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    expected = _reference_logits(reference, ids)
    kv = _kv(config, 64)
    with torch.inference_mode():
        model(ids[:20], kv, 0)  # the prefix (as if reused)
        suffix = model(ids[20:33], kv, 20, all_logits=True)  # 13 queries over 33 keys: lower-right causal
        steps = [model(ids[i : i + 1], kv, i) for i in range(33, 40)]  # decode one token at a time
    assert (suffix - expected[20:33]).abs().max().item() < TOL
    assert (torch.cat(steps) - expected[33:40]).abs().max().item() < TOL


def test_last_token_only_matches_transformers_and_runs_the_last_mlp_once(pair):
    """Without all_logits the last layer attends and runs its MLP for the last token alone (the
    compute left after a pool load's last layer arrives); its logits are still the full model's."""
    reference, model, config = pair
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(7))
    expected = _reference_logits(reference, ids)
    rows = []
    hook = model.model.layers[-1].mlp.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    try:
        with torch.inference_mode():
            cold = model(ids, _kv(config, 48), 0)  # a cold prefill: 40 queries, the last layer's for one
            kv = _kv(config, 48)
            model(ids[:24], kv, 0)
            suffix = model(ids[24:], kv, 24)  # a suffix over a reused prefix
    finally:
        hook.remove()
    assert cold.shape == suffix.shape == (1, expected.shape[1])
    assert (cold[0] - expected[-1]).abs().max().item() < TOL
    assert (suffix[0] - expected[-1]).abs().max().item() < TOL
    assert rows == [1, 1, 1]  # one row per forward through the last MLP, not 40, 24 and 16


def test_kv_is_stored_after_rope_like_transformers(pair):
    reference, model, config = pair
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = reference(ids[None], use_cache=True).past_key_values
    kv = _kv(config, 16)
    with torch.inference_mode():
        model(ids, kv, 0)
    for layer in range(config.num_layers):
        keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [H, T, D]
        assert (kv[layer, 0] - keys).abs().max().item() < TOL
        assert (kv[layer, 1] - values).abs().max().item() < TOL


def test_capacity_is_checked(pair):
    _reference, model, config = pair
    with pytest.raises(ValueError, match="capacity"):
        with torch.inference_mode():
            model(torch.zeros(10, dtype=torch.long), _kv(config, 8), 0)
