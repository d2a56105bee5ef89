"""Write a preset as an ordinary Hugging Face model directory (transformers and vLLM load it).

    DIR/config.json               the preset's config (sorted keys: the bytes are part of the fingerprint)
    DIR/model.safetensors         weights, written with a deterministic header
    DIR/tokenizer.json            the preset's tokenizer: byte level (tiny) or the BPE of kvshare.engine.bpe
    DIR/tokenizer_config.json     special tokens and the ChatML chat template
    DIR/generation_config.json    bos / eos ids

Same preset, dtype and init device -> the same files, byte for byte.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch

from kvshare.engine.bpe import preset_tokenizer_files
from kvshare.engine.presets import (
    build_preset,
    checkpoint_tensors,
    config_json_bytes,
    file_metadata,
    get_preset,
    preset_hf_config,
    preset_tensors,
)
from kvshare.engine.tokenizer import BOS_ID, EOS_ID, IM_END_ID
from kvshare.engine.weights import TORCH_DTYPES, model_dir_fingerprint, write_safetensors
from kvshare.errors import UserError
from kvshare.units import format_bytes

log = logging.getLogger(__name__)
LARGE_BYTES = 1 << 30  # above this, warn: the GPU presets are meant to be built on the device


def preset_weight_bytes(name: str, dtype: str | None = None) -> int:
    from kvshare.engine.architectures import new_model

    hf = preset_hf_config(get_preset(name), dtype)
    with torch.device("meta"):
        model = new_model(get_preset(name).config)
    itemsize = torch.empty((), dtype=TORCH_DTYPES[hf["dtype"]]).element_size()
    return sum(t.numel() for _n, t in preset_tensors(model)) * itemsize


def write_model_dir(name: str, out_dir: str, device: str = "cpu", dtype: str | None = None) -> str:
    """Build preset ``name`` on ``device`` and write it to ``out_dir``; returns the directory's weights fingerprint."""
    preset = get_preset(name)
    size = preset_weight_bytes(name, dtype)
    os.makedirs(out_dir, exist_ok=True)
    if size > LARGE_BYTES:
        log.warning(
            "preset %s has %s of weights; writing them to %s (the GPU presets are normally built on the device)",
            name,
            format_bytes(size),
            out_dir,
        )
        free = shutil.disk_usage(out_dir).free
        if free < size * 1.05:
            raise UserError(f"{out_dir} has {format_bytes(free)} free; preset {name} needs {format_bytes(size)}")
    dev = torch.device(device)
    model, _config, _recipe = build_preset(name, dev, dtype)
    tensors = checkpoint_tensors(model)
    draw_device = dev.type if preset.draw_on_device else "cpu"
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, file_metadata(preset, draw_device))
    del model, tensors
    write_model_files(name, out_dir, dtype)
    return model_dir_fingerprint(out_dir)  # what an engine loading the directory uses (its bytes' fingerprint)


def write_model_files(name: str, out_dir: str, dtype: str | None = None) -> None:
    """Everything of preset ``name``'s directory but its weights: the config and the tokenizer files
    (alone, for an engine that draws its own random weights: vLLM's ``--load-format dummy``)."""
    hf = preset_hf_config(get_preset(name), dtype)
    os.makedirs(out_dir, exist_ok=True)
    _write(os.path.join(out_dir, "config.json"), config_json_bytes(hf))
    write_tokenizer_files(name, out_dir)


def write_tokenizer_files(name: str, out_dir: str) -> None:
    """The tokenizer files of preset ``name`` (the same bytes on every run): what transformers and vLLM read."""
    preset = get_preset(name)
    tokenizer, tokenizer_config = preset_tokenizer_files(preset.tokenizer, preset.config.max_position_embeddings)
    _write(os.path.join(out_dir, "tokenizer.json"), tokenizer.to_str(pretty=True).encode())
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config)
    _write_json(
        os.path.join(out_dir, "special_tokens_map.json"),
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|eos|>"},
    )
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": EOS_ID},
    )


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _write_json(path: str, obj: dict) -> None:
    _write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
