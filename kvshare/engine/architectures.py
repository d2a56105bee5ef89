"""Which plain-torch model runs a configuration, and how checkpoints of it name their weights.

The attention decoders (Llama, Qwen2, Qwen3: kvshare.engine.model) and the Qwen3.5 hybrid
(kvshare.engine.hybrid_model) take the same call, ``model(tokens, kv, start, ...)``, and name their parameters
as transformers does. A published Qwen3.5 checkpoint nests the decoder under ``model.language_model.`` and
carries a vision tower (``model.visual.``) and a multi-token-prediction head (``mtp.``): the engine serves the
text decoder, so those are not loaded, and the directories make-model writes name the weights as those
checkpoints do.
"""

from __future__ import annotations

from torch import nn

from kvshare.engine.hybrid_model import HybridTransformer
from kvshare.engine.model import Transformer

LANGUAGE_MODEL_PREFIX = "model.language_model."
NOT_LOADED_PREFIXES = ("model.visual.", "mtp.")  # a hybrid checkpoint's vision tower and MTP head: text only


def new_model(config) -> nn.Module:
    """The model of ``config`` (a kvshare.engine.config.ModelConfig), with uninitialised weights."""
    return HybridTransformer(config) if config.is_hybrid else Transformer(config)


def engine_weight_name(config, name: str) -> str | None:
    """The model's parameter name for checkpoint tensor ``name``; None for a tensor the engine does not load."""
    if not config.is_hybrid:
        return name
    if name.startswith(NOT_LOADED_PREFIXES):
        return None
    if name.startswith(LANGUAGE_MODEL_PREFIX):
        return "model." + name[len(LANGUAGE_MODEL_PREFIX) :]
    return name


def checkpoint_weight_name(config, name: str) -> str:
    """The name a published checkpoint of ``config``'s family gives the model's parameter ``name``."""
    if config.is_hybrid and name.startswith("model."):
        return LANGUAGE_MODEL_PREFIX + name[len("model.") :]
    return name
