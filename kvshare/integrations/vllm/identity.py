"""A model directory's identity for the pool's key namespace: config.json + safetensors headers.

The same fingerprint as kvshare.keys.weights_fingerprint describes, read from a local
Hugging Face directory; any engine that loads the directory gets the same digest.
"""

from __future__ import annotations

import glob
import os
import struct

from kvshare.keys import Namespace, weights_fingerprint
from kvshare.layout import KVLayout

_HEADER_LEN = struct.Struct("<Q")
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


def read_safetensors_header(path: str) -> bytes:
    """The JSON header of a .safetensors file (names, dtypes, shapes, offsets of every tensor)."""
    with open(path, "rb") as f:
        prefix = f.read(_HEADER_LEN.size)
        if len(prefix) != _HEADER_LEN.size:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header length)")
        (length,) = _HEADER_LEN.unpack(prefix)
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {length} bytes is larger than the format allows")
        header = f.read(length)
    if len(header) != length:
        raise ValueError(f"{path}: truncated safetensors header")
    return header


def model_fingerprint(model_dir: str) -> str:
    """weights_fingerprint of a local model directory (config.json and its *.safetensors, by name)."""
    if not os.path.isdir(model_dir):
        raise ValueError(
            f"kvshare needs the model as a local directory to fingerprint its weights; got {model_dir!r}"
        )
    config_path = os.path.join(model_dir, "config.json")
    try:
        with open(config_path, "rb") as f:
            config_json = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {config_path}: {exc}") from None
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors files; kvshare fingerprints safetensors weights only")
    return weights_fingerprint(config_json, [read_safetensors_header(p) for p in files])


def default_model_id(model_dir: str) -> str:
    """The directory's name: the same for replicas that load one model from different paths."""
    return os.path.basename(os.path.normpath(model_dir))


def engine_namespace(model_dir: str, layout: KVLayout, engine_family: str, model_id: str = "",
                     kv_layout_id: str = "") -> Namespace:
    """The key namespace of a model directory served by ``engine_family`` with pages of ``layout``
    (``kv_layout_id``: how the engine's KV was read into them, kvshare.integrations.vllm.guards)."""
    return Namespace(
        model_id=model_id or default_model_id(model_dir),
        weights_fingerprint=model_fingerprint(model_dir),
        kv_dtype=layout.dtype,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        chunk_tokens=layout.chunk_tokens,
        engine_family=engine_family,
        kv_layout_id=kv_layout_id,
    )
