"""A hybrid model's set-up in the connector: from vLLM's objects at start, what its two sides need.

The rules are ``hybrid``'s (pure, over stand-ins); this module applies them to what vLLM hands the connector::

    at start           HybridSetup.of   the set-up checked (vLLM minor, device, chunk and block size, one rank);
                                        the pages hold the attention group's layers; the GDN checkpoints' layout
                                        (the recurrent dtype vLLM resolved) and the recurrent state's memory
                                        order in vLLM's blocks on this device (hybrid.recurrent_order)
                       attention_group  the cache group whose blocks the pages load and store
    register_kv_caches take_states      each GDN layer's [conv, ssm] state into the worker (StateBlocks); the
                                        attention layers' KV left for the pages

``None`` stands for any other model: one attention group, no state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvshare.integrations.vllm.guards import version_of
from kvshare.integrations.vllm.hybrid import (
    HybridGroups,
    check_hybrid_setup,
    recurrent_dtype_of,
    recurrent_order,
    state_layout_of,
)
from kvshare.integrations.vllm.layout import UnsupportedKVLayout
from kvshare.integrations.vllm.state_blocks import StateBlocks
from kvshare.state_layout import StateLayout

if TYPE_CHECKING:
    import torch

    from kvshare.integrations.vllm.options import ConnectorConfig

log = logging.getLogger("kvshare.integrations")


@dataclass(frozen=True)
class HybridSetup:
    """A Gated DeltaNet hybrid as the connector serves it: its cache groups, how many attention layers a page holds,
    the layout of its GDN state checkpoints (kvshare.state_layout) and the recurrent state's order in vLLM's blocks
    (state_blocks.HKV or HVK)."""

    groups: HybridGroups
    num_attention_layers: int
    state_layout: StateLayout
    recurrent_order: str

    @classmethod
    def of(
        cls, groups: HybridGroups, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, block_size: int
    ) -> HybridSetup:
        """The set-up of the model whose cache groups are ``groups``, checked (hybrid.check_hybrid_setup)."""
        import vllm

        minor, device = version_of(vllm.__version__), _device_type()
        check_hybrid_setup(
            minor,
            device,
            config.chunk_tokens,
            block_size,
            config.allow_untested_vllm,
            vllm_config.parallel_config.tensor_parallel_size,
        )
        attention = kv_cache_config.kv_cache_groups[groups.attention_group]
        model_dtype = str(vllm_config.model_config.dtype).replace("torch.", "")
        ssm_dtype = recurrent_dtype_of(vllm_config.cache_config.mamba_ssm_cache_dtype, model_dtype)
        text_config = vllm_config.model_config.hf_text_config
        layout = state_layout_of(text_config, model_dtype, len(groups.state_layers), ssm_dtype)
        setup = cls(groups, len(attention.layer_names), layout, recurrent_order(minor, device))
        log.info(
            "kvshare: a hybrid model: %d attention layers in pages, %d GDN layers in checkpoints of %.1f MiB "
            "(recurrent state %s, %s in vLLM's blocks)",
            setup.num_attention_layers,
            setup.state_layout.num_layers,
            setup.state_layout.checkpoint_bytes / 2**20,
            setup.state_layout.recurrent_dtype,
            setup.recurrent_order,
        )
        return setup

    def take_states(
        self, kv_caches: dict[str, Any], forward_context: dict[str, Any]
    ) -> tuple[StateBlocks, dict[str, torch.Tensor]]:
        """The GDN layers' state (each layer's ``kv_cache`` in vLLM's forward context, ``[conv, ssm]`` views of the
        blocks vLLM registered for it) for the worker, and the attention layers' KV of ``kv_caches`` left."""
        layers = []
        for name in self.groups.state_layers:
            state = getattr(forward_context.get(name), "kv_cache", None)
            if name not in kv_caches or not isinstance(state, (list, tuple)) or len(state) != 2:
                raise UnsupportedKVLayout(f"vLLM's GDN layer {name} keeps no [conv, ssm] state kvshare can read")
            layers.append(tuple(state))
        attention = {name: t for name, t in kv_caches.items() if name not in self.groups.state_layers}
        return StateBlocks(self.state_layout, layers, self.recurrent_order), attention


def attention_group(hybrid: HybridSetup | None) -> int:
    """Which of vLLM's KV cache groups holds the attention KV the pages hold (the first for a dense model)."""
    return hybrid.groups.attention_group if hybrid is not None else 0


def _device_type() -> str:
    from vllm.platforms import current_platform

    return current_platform.device_type
