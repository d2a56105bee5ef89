"""A synthetic preset's weights: random, drawn from its seed (what each preset is: kvshare.engine.preset_table).

The Qwen3 shapes are built directly on the device. Same preset, seed and init device -> the same weights,
bitwise.

A preset built in memory is named by its recipe: its weights are a function of the config.json
bytes and of the safetensors header, whose metadata holds FORMAT, the seed and the init device, so
the fingerprint hashes those two. The directory make-model writes is named, like every model
directory, by its bytes (kvshare.identity); the two fingerprints differ, so a replica of the preset
and a replica of its directory do not share KV.
"""

from __future__ import annotations

import json
import math

import torch
from torch import nn

from kvshare.engine.architectures import checkpoint_weight_name, new_model
from kvshare.engine.config import ModelConfig, model_config_from_hf
from kvshare.engine.hybrid_presets import A_MAX_LOG10, A_MIN_LOG10
from kvshare.engine.preset_table import PRESETS, Preset, get_preset, model_config_of, preset_hf_config
from kvshare.engine.weights import TORCH_DTYPES, assign_state, safetensors_header
from kvshare.keys import weights_fingerprint

# the table's names (kvshare.engine.preset_table) are this module's too: a preset and its weights in one import
__all__ = [
    "FORMAT",
    "PRESETS",
    "Preset",
    "build_preset",
    "checkpoint_tensors",
    "config_json_bytes",
    "file_metadata",
    "get_preset",
    "model_config_of",
    "preset_fingerprint",
    "preset_hf_config",
    "preset_tensors",
]

FORMAT = "kvshare-preset-v1"  # bump when the init below changes: it changes every preset's weights


def config_json_bytes(hf: dict) -> bytes:
    """The exact bytes of config.json (sorted keys: the fingerprint must not depend on dict order)."""
    return (json.dumps(hf, indent=2, sort_keys=True) + "\n").encode()


def file_metadata(preset: Preset, init_device: str) -> dict[str, str]:
    # the init device is part of the identity: CPU and CUDA generators give different numbers
    return {"format": "pt", "kvshare_preset": preset.name, "kvshare_init": f"{FORMAT}:{preset.seed}:{init_device}"}


def _tensor_std(preset: Preset, config: ModelConfig, name: str, shape: torch.Size) -> float | None:
    """std of a weight's entries; None: the tensor is filled (_tensor_fill)."""
    if (
        name.endswith("norm.weight")
        or name.endswith(".bias")
        or (config.is_hybrid and hybrid_fill(name, shape) is not None)
    ):
        return None
    if name == "model.embed_tokens.weight":
        return preset.embed_std
    if name == "lm_head.weight":
        return preset.head_gain / math.sqrt(config.hidden_size)
    return preset.linear_gain / math.sqrt(shape[-1])  # projections (and a conv's taps): fan_in is the last dimension


def hybrid_fill(name: str, shape: torch.Size) -> torch.Tensor | float | None:
    """The fixed init of a hybrid's tensor (a float: every entry; a tensor: its values), None where it is drawn.

    Qwen3.5's norms scale by (1 + weight): their weights start at 0 (a scale of 1), except the GDN's output norm
    (weight x); A_log spreads the heads' decay rates over three decades; dt_bias starts at 1 (transformers' init)."""
    if name.endswith("linear_attn.norm.weight"):
        return 1.0
    if name.endswith("norm.weight"):
        return 0.0
    if name.endswith("A_log"):
        return torch.linspace(A_MIN_LOG10, A_MAX_LOG10, shape[0], dtype=torch.float32) * math.log(10.0)
    if name.endswith("dt_bias"):
        return 1.0
    return None


def _tensor_fill(config: ModelConfig, name: str, shape: torch.Size) -> torch.Tensor | float:
    """The values of a tensor that is not drawn: norm weights 1, biases 0, a hybrid's own (hybrid_fill)."""
    if config.is_hybrid and (fill := hybrid_fill(name, shape)) is not None:
        return fill
    return 1.0 if name.endswith("norm.weight") else 0.0


def build_preset(name: str, device: torch.device, dtype: str | None = None) -> tuple[nn.Module, ModelConfig, str]:
    """(model on ``device``, config, weights fingerprint): random weights from the preset's seed."""
    preset = get_preset(name)
    hf = preset_hf_config(preset, dtype)
    config = model_config_from_hf(hf)
    target = TORCH_DTYPES[config.dtype]
    with torch.device("meta"):
        model = new_model(config)
    draw_device = torch.device(device) if preset.draw_on_device else torch.device("cpu")
    generator = torch.Generator(device=draw_device).manual_seed(preset.seed)
    state = {}
    for tensor_name, meta in preset_tensors(model):
        std = _tensor_std(preset, config, tensor_name, meta.shape)
        if std is None:
            fill = _tensor_fill(config, tensor_name, meta.shape)
            if isinstance(fill, torch.Tensor):
                state[tensor_name] = fill.to(device=device, dtype=target)
            else:
                state[tensor_name] = torch.full(meta.shape, fill, dtype=target, device=device)
        else:  # drawn in float32 whatever the target dtype, so dtypes differ only by rounding
            values = torch.empty(meta.shape, dtype=torch.float32, device=draw_device).normal_(
                0.0, std, generator=generator
            )
            state[tensor_name] = values.to(device=device, dtype=target)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    assign_state(model, state, f"preset {name}")
    return model, config, preset_fingerprint(preset, dtype, draw_device)


def preset_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors a preset file holds, in file order (a tied head is stored once, as the embedding), by
    the model's names (``checkpoint_tensors``: by the file's)."""
    items = list(model.state_dict().items())
    if model.config.tie_word_embeddings:
        items = [(n, t) for n, t in items if n != "lm_head.weight"]
    return items


def checkpoint_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """preset_tensors named as a published checkpoint of the model's family names them (its file's names)."""
    return [(checkpoint_weight_name(model.config, n), t) for n, t in preset_tensors(model)]


def preset_fingerprint(preset: Preset, dtype: str | None, draw_device: torch.device) -> str:
    hf = preset_hf_config(preset, dtype)
    config = model_config_from_hf(hf)
    with torch.device("meta"):
        model = new_model(config)
    target = TORCH_DTYPES[config.dtype]
    shapes = [(n, target, tuple(t.shape)) for n, t in checkpoint_tensors(model)]
    header = safetensors_header(shapes, file_metadata(preset, torch.device(draw_device).type))
    return weights_fingerprint(config_json_bytes(hf), [header])
