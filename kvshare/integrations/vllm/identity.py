"""A vLLM replica's identity in the pool's key namespace: the weights' bytes and what vLLM runs them with.

The weights are named by their content (kvshare.identity, the function the built-in engine
uses too), never by the directory's name; the configuration by what the engine actually
uses: the hf config as resolved after ``--hf-overrides`` (rope parameters included), the
dtype, the quantization method, the KV cache dtype and, where the rope is scaled,
``--max-model-len``. A LoRA adapter is named by its bytes, never by its name.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from kvshare.identity import IdentityError, adapter_fingerprint, model_fingerprint
from kvshare.keys import Namespace, config_fingerprint
from kvshare.layout import KVLayout

log = logging.getLogger(__name__)
# hf config keys that say where or by which library version a config was read, not how the model computes
_NOT_CONFIG = ("transformers_version",)


def _plain(value: Any) -> Any:
    """``value`` with hf config objects turned into dicts, private and provenance keys dropped, recursively."""
    if hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if not str(k).startswith("_") and k not in _NOT_CONFIG}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def _has_scaled_rope(hf: dict) -> bool:
    for name in ("rope_scaling", "rope_parameters"):
        block = hf.get(name)
        if isinstance(block, dict):
            kind = block.get("rope_type", block.get("type", "default"))
            if kind not in (None, "default"):
                return True
    return False


def effective_config(vllm_config: Any) -> dict:
    """What vLLM runs the model with, as far as it changes the KV it computes for a token sequence."""
    model_config = vllm_config.model_config
    hf = _plain(model_config.hf_config)  # after --hf-overrides: rope_theta, rope_scaling, ...
    config = {
        "hf_config": hf,
        "dtype": str(model_config.dtype),
        "quantization": str(getattr(model_config, "quantization", None)),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
    }
    if _has_scaled_rope(hf) or _has_scaled_rope(hf.get("text_config") or {}):
        config["max_model_len"] = model_config.max_model_len  # scaled rope may depend on the context length
    return config


def engine_namespace(
    model_dir: str,
    layout: KVLayout,
    engine_family: str,
    model_revision: str = "",
    kv_layout_id: str = "",
    config_id: str = "",
) -> Namespace:
    """The key namespace of a model directory served by ``engine_family`` with pages of ``layout``
    (``kv_layout_id``: how the engine's KV was read into them, kvshare.integrations.vllm.guards;
    ``config_id``: config_fingerprint of effective_config). ``model_revision`` names the weights
    instead of hashing them: the user's word that every replica with it loads the same bytes."""
    return Namespace(
        model_id=model_revision,
        weights_fingerprint="" if model_revision else model_fingerprint(model_dir),
        kv_dtype=layout.dtype,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        chunk_tokens=layout.chunk_tokens,
        engine_family=engine_family,
        kv_layout_id=kv_layout_id,
        config_id=config_id,
    )


def vllm_namespace(
    vllm_config: Any, layout: KVLayout, engine_family: str, model_revision: str = "", kv_layout_id: str = ""
) -> Namespace:
    """engine_namespace of the model vLLM serves, with the configuration it serves it with."""
    return engine_namespace(
        vllm_config.model_config.model,
        layout,
        engine_family,
        model_revision,
        kv_layout_id,
        config_fingerprint(effective_config(vllm_config)),
    )


class LoraIdentities:
    """The namespace's lora_id of each adapter: its bytes' fingerprint, computed once per (id, path)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, str], str | None] = {}
        self._lock = threading.Lock()

    def of(self, lora_request: Any) -> str | None:
        """ "" without an adapter; None when the adapter's bytes cannot be read (its requests skip the pool)."""
        if lora_request is None:
            return ""
        path = str(getattr(lora_request, "lora_path", "") or getattr(lora_request, "path", "") or "")
        key = (int(getattr(lora_request, "lora_int_id", 0)), path)
        with self._lock:
            if key not in self._known:
                try:
                    self._known[key] = "lora:" + adapter_fingerprint(os.path.abspath(path)) if path else None
                except IdentityError as exc:
                    log.warning(
                        "kvshare: LoRA adapter %s is not shared through the pool: %s",
                        getattr(lora_request, "lora_name", path),
                        exc,
                    )
                    self._known[key] = None
            return self._known[key]
