"""Weights on disk: safetensors headers, the weights fingerprint, loading and deterministic writing.

A model directory is an ordinary Hugging Face one: ``config.json`` plus one or more
``*.safetensors`` files (sharded files are read in file-name order). The weights
fingerprint (part of every pool key) hashes config.json and every byte of the
safetensors files (kvshare.identity, cached per file).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable

import torch
from torch import nn

from kvshare.engine.architectures import engine_weight_name, new_model
from kvshare.engine.config import ModelConfig, model_config_from_hf
from kvshare.errors import UserError
from kvshare.identity import model_fingerprint
from kvshare.transfer.layouts import TORCH_DTYPES  # a model's dtypes (ModelConfig.dtype) are among the KV's

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_HEADER_LEN = struct.Struct("<Q")
# names some checkpoints carry that hold no weights (recomputed here)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: str) -> list[str]:
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise UserError(f"no *.safetensors file in {model_dir} (the built-in engine reads safetensors only)")
    return [os.path.join(model_dir, n) for n in names]


def model_dir_fingerprint(model_dir: str) -> str:
    """The content fingerprint of a model directory (the one vLLM's connector computes too)."""
    return model_fingerprint(model_dir)


def read_model_config(model_dir: str) -> tuple[dict, ModelConfig]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{model_dir} is not a model directory (no config.json) and not a preset name")
    with open(path) as f:
        hf = json.load(f)
    return hf, model_config_from_hf(hf)


def load_model_dir(
    model_dir: str, device: torch.device, dtype: str | None = None, is_fingerprinted: bool = True
) -> tuple[nn.Module, ModelConfig, str]:
    """(model on ``device``, its config, weights fingerprint) from a local HF directory; the fingerprint is
    empty when ``is_fingerprinted`` is False (the user named the model's identity with --model-revision).
    Tensors the engine does not run (a hybrid checkpoint's vision tower and MTP head) are not read."""
    from safetensors import safe_open

    _hf, config = read_model_config(model_dir)
    if dtype is not None and dtype != config.dtype:
        config = ModelConfig(**{**config.__dict__, "dtype": dtype})
    target = TORCH_DTYPES[config.dtype]
    with torch.device("meta"):
        model = new_model(config)
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device=str(device)) as f:
            for name in f.keys():
                own = engine_weight_name(config, name)
                if own is not None and not name.endswith(_IGNORED_SUFFIXES):
                    state[own] = f.get_tensor(name).to(target)
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    assign_state(model, state, model_dir)
    return model, config, model_dir_fingerprint(model_dir) if is_fingerprinted else ""


def assign_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Put ``state`` into a meta-built model, checking that names and shapes match exactly."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(
            f"{source}: weights do not match the configuration: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise UserError(
                f"{source}: {name} has shape {tuple(state[name].shape)}, the configuration needs {tuple(tensor.shape)}"
            )
    model.load_state_dict(state, strict=True, assign=True)
    model.setup_buffers()
    model.eval()


def safetensors_header(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """A deterministic safetensors header for tensors laid out back to back in the given order."""
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape in tensors:
        num_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + num_bytes],
        }
        offset += num_bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # pad so the data (and every tensor in it) starts 8-aligned


def write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    """Write ``tensors`` in the given order with ``safetensors_header``; returns the header bytes."""
    header = safetensors_header([(n, t.dtype, tuple(t.shape)) for n, t in tensors], metadata)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(_HEADER_LEN.pack(len(header)))
        f.write(header)
        for _name, tensor in tensors:
            # raw little-endian bytes of the tensor (bf16 through a uint8 view: numpy has no bf16)
            f.write(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)
    return header
