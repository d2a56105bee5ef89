"""A hybrid model (Gated DeltaNet layers beside full attention) in vLLM: what its cache holds and what may be shared.

Pure: duck-typed over vLLM's config objects (``KVCacheConfig``, its groups and specs, the HF text config), so it is
tested with stand-ins; nothing here imports vLLM or torch.

vLLM's hybrid KV cache manager keeps one group of full-attention layers and several groups of GDN layers, all of one
block size (the attention page is made at least as large as a GDN state: 784 tokens for Qwen3.5-27B in bf16 on
CUDA, 640 for the tests' tiny model on CPU). With ``--mamba-cache-mode align`` each GDN layer keeps, per request, the
state at the end of the step in the block of that step's last token::

    tokens     |--- block 0 ---|--- block 1 ---|--- block 2 ---|
    GDN state                  ^ block 0        ^ block 1        the state after j * N tokens: block j - 1 of each
                                                                 GDN group's table (vLLM resumes from there)

So a prefix of j chunks (C = m * N tokens each) is resumed with the attention KV of its chunks and the GDN state
after it, which the pool holds as one checkpoint page (kvshare.state_layout) under the chunk's state key: a hit ends
at the deepest checkpoint, never beyond it, and vLLM computes the rest. A checkpoint is stored where a step ends on
a chunk boundary (every block boundary is one when ``--max-num-batched-tokens`` lies in [N, 2N)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvshare.state_layout import StateLayout

# (vLLM major.minor, device) with which a hybrid model's state was moved end to end; any other known pair of
# GDN_RECURRENT_ORDER runs only with allow_untested_vllm
TESTED_HYBRID_VLLM = (("0.32", "cpu"),)
# How a GDN layer's recurrent state lies in memory in one vLLM block, by (vLLM major.minor, device), read from vLLM's
# sources (kvshare.integrations.vllm.state_blocks names the lines): "HKV" [value head][key dim][value dim], the
# checkpoint's order; "HVK" [value head][value dim][key dim]. A pair not here is refused: with K == V (every Qwen3.5
# and Qwen3-Next model) the tensors' shapes cannot tell the two apart.
GDN_RECURRENT_ORDER = {
    ("0.26", "cpu"): "HKV",  # vLLM CPU's GDN kernel views the [HV, V, K] spec as [HV, K, V]
    ("0.32", "cpu"): "HKV",
    ("0.26", "cuda"): "HVK",  # the FLA Triton kernels read and write [HV, V, K], as the spec names it
    ("0.32", "cuda"): "HVK",
}
GDN_BACKEND = "GDN_ATTN"  # vLLM's MambaAttentionBackendEnum member of Gated DeltaNet layers
# the smallest kernel block size of vLLM's attention backends (its _align_hybrid_block_size rounds up to these)
BLOCK_ALIGNMENT = {"cpu": 128, "cuda": 16}


class UnsupportedHybrid(ValueError):
    """A hybrid model set up in a way whose state the connector cannot move right; the message names the setting."""


@dataclass(frozen=True)
class HybridGroups:
    """vLLM's cache groups of one hybrid model: the full-attention one and the GDN ones (indices into
    ``kv_cache_groups``), with the GDN layers' names in model order (the checkpoint's layer order)."""

    attention_group: int
    state_groups: tuple[int, ...]
    state_layers: tuple[str, ...]  # GDN layer names, by model layer index
    layer_groups: tuple[int, ...]  # per GDN layer (same order): the group whose block table holds its state
    block_size: int

    def state_blocks(self, position: int, tables) -> tuple[int, ...]:
        """Per GDN layer, the block holding its state after ``position`` tokens; ``tables``: the request's block
        ids per cache group."""
        return tuple(state_block(position, self.block_size, tables[g]) for g in self.layer_groups)


def layer_index(name: str) -> int:
    """The model layer index in a vLLM layer name ("model.layers.12.linear_attn" -> 12)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    raise UnsupportedHybrid(f"vLLM layer name {name!r} holds no layer index")


def _is_gdn(spec: Any) -> bool:
    kind = getattr(spec, "mamba_type", None)
    return type(spec).__name__ == "MambaSpec" and getattr(kind, "name", str(kind)) == GDN_BACKEND


def hybrid_groups(kv_cache_config: Any) -> HybridGroups | None:
    """The groups of a hybrid of one full-attention group and Gated DeltaNet groups; None for any other model. Raises
    UnsupportedHybrid, naming the setting to change, where vLLM keeps their state where the connector cannot move it
    right (not in align mode, with speculative blocks, in groups of several block sizes)."""
    if kv_cache_config is None:
        return None
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) == 1:
        return None
    attention = [i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "FullAttentionSpec"]
    states = [i for i, g in enumerate(groups) if _is_gdn(g.kv_cache_spec)]
    if len(attention) != 1 or not states or len(attention) + len(states) != len(groups):
        return None  # not this family: guards.non_attention_state names what it holds
    for i in states:
        spec = groups[i].kv_cache_spec
        if getattr(spec, "mamba_cache_mode", "none") != "align":
            raise UnsupportedHybrid(
                f"the GDN state is kept in mamba_cache_mode {getattr(spec, 'mamba_cache_mode', None)!r}: kvshare "
                "moves it only where vLLM snapshots it at block boundaries; start vLLM with --mamba-cache-mode align"
            )
        if getattr(spec, "num_speculative_blocks", 0):
            raise UnsupportedHybrid("speculative decoding keeps extra GDN state blocks; run without it")
    sizes = {g.kv_cache_spec.block_size for g in groups}
    if len(sizes) != 1:
        raise UnsupportedHybrid(f"the cache groups use block sizes {sorted(sizes)}; kvshare needs one")
    layers = sorted(((name, i) for i in states for name in groups[i].layer_names), key=lambda x: layer_index(x[0]))
    return HybridGroups(
        attention[0], tuple(states), tuple(n for n, _ in layers), tuple(g for _, g in layers), sizes.pop()
    )


def state_layout_of(
    text_config: Any, model_dtype: str, num_gdn_layers: int, recurrent_dtype: str | None = None
) -> StateLayout:
    """The checkpoint layout of a Qwen3.5 / Qwen3-Next text config as vLLM keeps its state: the recurrent state in
    ``recurrent_dtype`` (vLLM's resolved ``mamba_ssm_cache_dtype``: recurrent_dtype_of; None: the config's
    ``mamba_ssm_dtype``, else float32), the conv state in the model's dtype."""
    get = lambda name: getattr(text_config, name)  # noqa: E731
    key_dim, value_dim = get("linear_key_head_dim"), get("linear_value_head_dim")
    num_key_heads, num_value_heads = get("linear_num_key_heads"), get("linear_num_value_heads")
    ssm_dtype = recurrent_dtype or str(getattr(text_config, "mamba_ssm_dtype", None) or "float32")
    return StateLayout(
        num_layers=num_gdn_layers,
        num_value_heads=num_value_heads,
        key_head_dim=key_dim,
        value_head_dim=value_dim,
        conv_dim=2 * num_key_heads * key_dim + num_value_heads * value_dim,
        conv_kernel=get("linear_conv_kernel_dim"),
        recurrent_dtype=ssm_dtype.replace("torch.", ""),
        conv_dtype=model_dtype,
    )


def recurrent_dtype_of(mamba_ssm_cache_dtype: str, model_dtype: str) -> str:
    """The recurrent state's dtype in vLLM's blocks from its resolved cache config: ``auto`` is the model's dtype
    (vLLM's MambaStateDtypeCalculator); vLLM CPU sets float32, Qwen3.5 the config's ``mamba_ssm_dtype`` (float32)."""
    return model_dtype if mamba_ssm_cache_dtype == "auto" else str(mamba_ssm_cache_dtype).replace("torch.", "")


def recurrent_order(vllm_minor: str, device: str) -> str:
    """The memory order of a GDN layer's recurrent state in vLLM ``vllm_minor``'s blocks on ``device``
    (GDN_RECURRENT_ORDER); UnsupportedHybrid where it is not known."""
    order = GDN_RECURRENT_ORDER.get((vllm_minor, device))
    if order is None:
        known = ", ".join(f"{minor} on {dev}" for minor, dev in GDN_RECURRENT_ORDER)
        raise UnsupportedHybrid(
            f"kvshare knows how vLLM lays out a GDN layer's recurrent state only for vLLM {known}, not vLLM "
            f"{vllm_minor} on {device}; run this model without kvshare's connector (--kv-transfer-config unset)"
        )
    return order


def check_hybrid_setup(
    vllm_minor: str, device: str, chunk_tokens: int, block_size: int, allow_untested: bool, tp_size: int = 1
) -> None:
    """Refuse, naming the setting to change, a hybrid set-up whose state the connector was not shown to move right:
    an unknown state layout always, a known one not run end to end unless ``allow_untested``."""
    if tp_size != 1:
        raise UnsupportedHybrid(
            f"kvshare moves a hybrid model's GDN state with one rank only (--tensor-parallel-size 1), not {tp_size}"
        )
    recurrent_order(vllm_minor, device)
    if (vllm_minor, device) not in TESTED_HYBRID_VLLM and not allow_untested:
        tested = ", ".join(f"vLLM {minor} on {dev}" for minor, dev in TESTED_HYBRID_VLLM)
        raise UnsupportedHybrid(
            f"kvshare moved a hybrid model's GDN state end to end with {tested} only, not with vLLM {vllm_minor} on "
            f"{device} (whose state layout is known from vLLM's sources, unproven by a run); set "
            '"allow_untested_vllm": true in kv_connector_extra_config to run it anyway'
        )
    if chunk_tokens % block_size:
        raise UnsupportedHybrid(
            f"kvshare chunk_tokens ({chunk_tokens}) must be a multiple of vLLM's block size for this hybrid model "
            f"({block_size}, chosen by vLLM so that an attention page holds a GDN state); set "
            f"kv_connector_extra_config.chunk_tokens to {block_size}"
        )


def hybrid_block_size(text_config: dict, dtype_bytes: int, device: str) -> int:
    """The block size vLLM chooses for a Qwen3.5 / Qwen3-Next model (its _align_hybrid_block_size): the smallest
    multiple of the attention kernels' block alignment whose attention page holds one layer's GDN state."""
    key_dim, value_dim = text_config["linear_key_head_dim"], text_config["linear_value_head_dim"]
    num_value_heads = text_config["linear_num_value_heads"]
    conv_dim = 2 * text_config["linear_num_key_heads"] * key_dim + num_value_heads * value_dim
    state_bytes = (text_config["linear_conv_kernel_dim"] - 1) * conv_dim * dtype_bytes
    state_bytes += num_value_heads * key_dim * value_dim * 4  # float32 recurrent state
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // text_config["num_attention_heads"]
    token_bytes = 2 * text_config["num_key_value_heads"] * head_dim * dtype_bytes
    align = BLOCK_ALIGNMENT[device]
    return align * -(-state_bytes // (align * token_bytes))


def state_block(position: int, block_size: int, block_ids) -> int:
    """The block of a GDN group's table holding the state after ``position`` tokens (a block boundary)."""
    if position <= 0 or position % block_size:
        raise ValueError(
            f"a GDN state is kept at block boundaries (blocks of {block_size}), not after {position} tokens"
        )
    return block_ids[position // block_size - 1]


def checkpoint_chunks(num_prompt_tokens: int, chunk_tokens: int, every: int) -> set[int]:
    """The chunk counts b whose state a prompt's prefill stores: its last whole chunk (where its next turn resumes),
    the last before its last token (where the same prompt resumes on another replica) and every ``every`` chunks
    (0: none between), as the built-in engine keeps them (kvshare.engine.hybrid_prefill)."""
    whole = num_prompt_tokens // chunk_tokens
    ends = {whole, min(whole, (num_prompt_tokens - 1) // chunk_tokens)}
    between = set(range(every, max(ends), every)) if every else set()
    return {b for b in ends | between if b > 0}


def resume_points(num_computed_tokens: int, load_end_limit: int, end_chunk: int, chunk_tokens: int) -> list[int]:
    """The chunk counts j a load may end at, deepest first: past vLLM's own hit, at or before the longest load vLLM
    accepts (``load_end_limit``: whole blocks, the last prompt token left over), among the prompt's full chunks."""
    return [j for j in range(end_chunk, 0, -1) if num_computed_tokens < j * chunk_tokens <= load_end_limit]
