"""A model's tokenizer without its weights (no torch): a model directory's tokenizer.json, or a preset's.

The engine loads it beside the weights (kvshare.engine.loader); the router loads only this, to place prompts by
their token ids.
"""

from __future__ import annotations

import os

from kvshare.engine.bpe import preset_tokenizer
from kvshare.engine.preset_table import PRESETS
from kvshare.engine.token_cache import TokenCacheConfig
from kvshare.engine.tokenizer import Tokenizer
from kvshare.errors import UserError


def load_tokenizer(model: str, cache_config: TokenCacheConfig = TokenCacheConfig()) -> Tokenizer:
    """The tokenizer of a model directory (its tokenizer.json) or of a built-in preset (byte level or BPE); long
    texts cut and cached by ``cache_config`` (kvshare.engine.token_cache)."""
    if os.path.isdir(model):
        return Tokenizer.from_dir(model, cache_config)
    if model in PRESETS:
        return preset_tokenizer(PRESETS[model].tokenizer, PRESETS[model].config.max_position_embeddings, cache_config)
    raise UserError(f"--tokenizer/--model {model!r} is neither a model directory nor a preset ({', '.join(PRESETS)})")
