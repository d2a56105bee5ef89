"""Resolve ``--model DIR|PRESET`` into a model on its device, its tokenizer and its identity."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvshare.engine.config import ModelConfig
from kvshare.engine.model import Transformer
from kvshare.engine.preset_table import PRESETS
from kvshare.engine.presets import build_preset
from kvshare.engine.tokenizer import Tokenizer
from kvshare.engine.tokenizer_loader import load_tokenizer
from kvshare.engine.weights import load_model_dir
from kvshare.errors import UserError
from kvshare.keys import config_fingerprint


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: Tokenizer
    weights_fingerprint: str  # "" when the user names the model's identity (--model-revision)
    name: str  # the served name (never part of the key namespace)

    def identity(self, model_revision: str) -> dict[str, str]:
        """The Namespace fields that name this model: the user's revision, else its weights' fingerprint; and the
        configuration the engine runs it with (dtype after --dtype, rope, norms, biases: ModelConfig)."""
        return {
            "model_id": model_revision,
            "weights_fingerprint": "" if model_revision else self.weights_fingerprint,
            "config_id": config_fingerprint(self.config.identity_fields()),
        }


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} asked for, but this machine has no usable CUDA device")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def load_model(
    model: str, device: torch.device, dtype: str | None = None, name: str | None = None, model_revision: str = ""
) -> LoadedModel:
    """A local HF directory when ``model`` is one, else a preset name; a directory's weights are fingerprinted
    by their bytes unless ``model_revision`` names them (a preset is named by its recipe, kvshare.engine.presets)."""
    if os.path.isdir(model):
        net, config, fingerprint = load_model_dir(model, device, dtype, is_fingerprinted=not model_revision)
        default_name = os.path.basename(os.path.normpath(model))
    elif model in PRESETS:
        net, config, fingerprint = build_preset(model, device, dtype)
        default_name = model
    else:
        raise UserError(f"--model {model!r} is neither a model directory nor a preset ({', '.join(PRESETS)})")
    return LoadedModel(net, config, load_tokenizer(model), fingerprint, name or default_name)
