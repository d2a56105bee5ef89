"""Resolve ``--model DIR|PRESET`` into a model on its device, its tokenizer and its identity."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvshare.engine.config import ModelConfig
from kvshare.engine.model import Transformer
from kvshare.engine.presets import PRESETS, build_preset
from kvshare.engine.tokenizer import Tokenizer
from kvshare.engine.weights import load_model_dir
from kvshare.errors import UserError


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: Tokenizer
    weights_fingerprint: str
    name: str  # the served name / the key namespace's model id


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} asked for, but this machine has no usable CUDA device")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def load_model(model: str, device: torch.device, dtype: str | None = None, name: str | None = None) -> LoadedModel:
    """A local HF directory when ``model`` is one, else a preset name."""
    if os.path.isdir(model):
        net, config, fingerprint = load_model_dir(model, device, dtype)
        tokenizer = Tokenizer.from_dir(model)
        default_name = os.path.basename(os.path.normpath(model))
    elif model in PRESETS:
        net, config, fingerprint = build_preset(model, device, dtype)
        tokenizer = Tokenizer.byte_level(config.max_position_embeddings)
        default_name = model
    else:
        raise UserError(f"--model {model!r} is neither a model directory nor a preset ({', '.join(PRESETS)})")
    return LoadedModel(net, config, tokenizer, fingerprint, name or default_name)


def load_tokenizer(model: str):
    """The tokenizer of a model directory (its tokenizer.json) or of a built-in preset (byte level)."""
    if os.path.isdir(model):
        return Tokenizer.from_dir(model)
    if model in PRESETS:
        return Tokenizer.byte_level(PRESETS[model].config.max_position_embeddings)
    raise UserError(f"--tokenizer/--model {model!r} is neither a model directory nor a preset ({', '.join(PRESETS)})")
