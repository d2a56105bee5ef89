"""A hybrid model's rules in the connector without a vLLM server: its cache groups, the guards that refuse what
cannot be right, where a load may end and which checkpoints a prefill stores, the GDN state between vLLM's blocks
and a checkpoint page, the connector's set-up of it from vLLM's objects, the settings ``kvshare up`` gives vLLM
for it."""

import dataclasses
import importlib.util
import json
from enum import Enum
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvshare.integrations.vllm.guards import non_attention_state
from kvshare.integrations.vllm.hybrid import (
    UnsupportedHybrid,
    check_hybrid_setup,
    checkpoint_chunks,
    hybrid_block_size,
    hybrid_groups,
    recurrent_dtype_of,
    recurrent_order,
    resume_points,
    state_block,
    state_layout_of,
)
from kvshare.integrations.vllm.hybrid_setup import HybridSetup, attention_group
from kvshare.integrations.vllm.launch import VllmServerConfig, hybrid_settings, vllm_server_command
from kvshare.integrations.vllm.layout import UnsupportedKVLayout
from kvshare.integrations.vllm.state_blocks import HKV, HVK, StateBlocks
from kvshare.keys import Namespace, namespace_digest
from kvshare.state_layout import StateLayout


class MambaAttentionBackendEnum(Enum):
    GDN_ATTN = "gdn"
    MAMBA2 = "mamba2"


@dataclasses.dataclass
class FullAttentionSpec:
    block_size: int = 640


@dataclasses.dataclass
class MambaSpec:
    block_size: int = 640
    mamba_type: MambaAttentionBackendEnum = MambaAttentionBackendEnum.GDN_ATTN
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0


@dataclasses.dataclass
class SlidingWindowSpec:
    block_size: int = 640


def qwen3_next_groups(**mamba):
    """vLLM 0.32's groups of the tests' tiny Qwen3-Next: three GDN groups of two layers, attention last."""
    groups = [
        SimpleNamespace(
            kv_cache_spec=MambaSpec(**mamba),
            layer_names=[f"model.layers.{i}.linear_attn", f"model.layers.{i + 4}.linear_attn"],
        )
        for i in range(3)
    ]
    attention = ["model.layers.3.self_attn.attn", "model.layers.7.self_attn.attn"]
    groups.append(SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=attention))
    return SimpleNamespace(kv_cache_groups=groups, kv_cache_tensors=[])


def test_groups_of_a_gdn_hybrid_in_model_order():
    groups = hybrid_groups(qwen3_next_groups())
    assert groups.attention_group == 3 and groups.state_groups == (0, 1, 2)
    assert groups.state_layers == tuple(f"model.layers.{i}.linear_attn" for i in (0, 1, 2, 4, 5, 6))
    assert groups.layer_groups == (0, 1, 2, 0, 1, 2)
    tables = ([10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42])
    assert groups.state_blocks(2 * 640, tables) == (11, 21, 31, 11, 21, 31)  # the block of the 1280th token
    assert non_attention_state(qwen3_next_groups()) is not None  # the other path would not share it


def test_other_multi_group_models_are_left_to_the_plain_guard():
    one = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=FullAttentionSpec(), layer_names=[])])
    assert hybrid_groups(one) is None and hybrid_groups(None) is None
    config = qwen3_next_groups()
    config.kv_cache_groups[0].kv_cache_spec = SlidingWindowSpec()
    assert hybrid_groups(config) is None and "SlidingWindowSpec" in non_attention_state(config)
    config = qwen3_next_groups(mamba_type=MambaAttentionBackendEnum.MAMBA2)
    assert hybrid_groups(config) is None


@pytest.mark.parametrize(
    "change, setting",
    [({"mamba_cache_mode": "all"}, "--mamba-cache-mode align"), ({"num_speculative_blocks": 2}, "speculative")],
)
def test_state_kept_where_it_cannot_be_moved_right_is_refused_by_name(change, setting):
    with pytest.raises(UnsupportedHybrid, match=setting):
        hybrid_groups(qwen3_next_groups(**change))


def test_setup_guards_name_the_setting_to_change():
    check_hybrid_setup("0.32", "cpu", 640, 640, allow_untested=False)
    check_hybrid_setup("0.32", "cpu", 1280, 640, allow_untested=False)
    with pytest.raises(UnsupportedHybrid, match="chunk_tokens to 640"):
        check_hybrid_setup("0.32", "cpu", 256, 640, allow_untested=False)  # another block size than vLLM's
    with pytest.raises(UnsupportedHybrid, match="allow_untested_vllm"):
        check_hybrid_setup("0.26", "cpu", 640, 640, allow_untested=False)  # a minor not tested with
    check_hybrid_setup("0.26", "cpu", 640, 640, allow_untested=True)
    with pytest.raises(UnsupportedHybrid, match="tensor-parallel-size 1"):
        check_hybrid_setup("0.32", "cpu", 640, 640, allow_untested=False, tp_size=2)
    for minor in ("0.26", "0.32"):  # CUDA: the state layout known from vLLM's sources, no run has moved it yet
        with pytest.raises(UnsupportedHybrid, match=f"not with vLLM {minor} on cuda.*allow_untested_vllm"):
            check_hybrid_setup(minor, "cuda", 784, 784, allow_untested=False)
        check_hybrid_setup(minor, "cuda", 784, 784, allow_untested=True)


QWEN35_27B_TEXT = dict(
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_conv_kernel_dim=4,
    head_dim=256,
    num_key_value_heads=4,
    num_attention_heads=24,
    hidden_size=5120,
)
TINY_TEXT = dict(QWEN35_27B_TEXT, linear_num_key_heads=2, linear_num_value_heads=4, head_dim=64, num_key_value_heads=2)


def test_block_size_is_the_one_vllm_chooses():
    assert hybrid_block_size(QWEN35_27B_TEXT, 2, "cuda") == 784  # Qwen3.5-27B, bf16 KV, vLLM's CUDA backends
    assert hybrid_block_size(TINY_TEXT, 2, "cpu") == 640  # what vLLM CPU 0.32 logged for the tests' tiny model


def test_state_layout_follows_the_config_and_separates_namespaces():
    layout = state_layout_of(SimpleNamespace(**QWEN35_27B_TEXT), "bfloat16", 48)
    assert layout.conv_dim == 2 * 16 * 128 + 48 * 128 and layout.recurrent_dtype == "float32"
    assert 146 << 20 < layout.checkpoint_bytes < 148 << 20  # ~147 MiB a sequence
    tiny = state_layout_of(SimpleNamespace(**TINY_TEXT), "bfloat16", 6)
    base = Namespace("m", "f" * 32, "bfloat16", 2, 2, 64, engine_family="vllm")
    digests = {namespace_digest(dataclasses.replace(base, state_layout_id=s.fingerprint())) for s in (layout, tiny)}
    assert len(digests) == 2 and namespace_digest(base) not in digests


def test_a_load_ends_at_a_checkpoint_past_the_local_hit_and_before_the_last_token():
    C = 640
    assert resume_points(0, 1920, 3, C) == [3, 2, 1]
    assert resume_points(640, 1920, 3, C) == [3, 2]
    assert resume_points(0, 1280, 2, C) == [2, 1]  # 1280 tokens whole: its last token is computed
    assert resume_points(1920, 1920, 3, C) == []


def test_checkpoints_a_prefill_stores():
    assert checkpoint_chunks(2000, 640, 64) == {3}
    assert checkpoint_chunks(1280, 640, 64) == {1, 2}  # the end and one chunk before (where it resumes)
    assert checkpoint_chunks(640 * 10 + 5, 640, 4) == {4, 8, 10}
    assert checkpoint_chunks(100, 640, 4) == set()
    assert state_block(1280, 640, [7, 9, 11]) == 9
    with pytest.raises(ValueError, match="block boundaries"):
        state_block(1000, 640, [7, 9])


def gdn_tensors(layout: StateLayout, num_blocks: int, seed: int):
    """vLLM CPU's per-layer [conv "SD", ssm] views, filled at random."""
    g = torch.Generator().manual_seed(seed)
    channels, inputs = layout.conv_shape
    conv = torch.randn(num_blocks, inputs, channels, generator=g).to(torch.bfloat16)
    ssm = torch.randn(num_blocks, *layout.recurrent_shape, generator=g)
    return conv, ssm


def test_gdn_state_moves_bit_for_bit_through_a_checkpoint_page():
    layout = StateLayout(2, 4, 8, 8, 48, 4, "float32", "bfloat16")
    src = [gdn_tensors(layout, 5, seed) for seed in (1, 2)]
    dst = [(torch.zeros_like(c), torch.zeros_like(s)) for c, s in src]
    page = np.full(layout.checkpoint_bytes, 0xFF, dtype=np.uint8)
    StateBlocks(layout, src, HKV).read((3, 1), page)
    StateBlocks(layout, dst, HKV).write(page, (4, 2))
    assert torch.equal(dst[0][0][4], src[0][0][3]) and torch.equal(dst[0][1][4], src[0][1][3])
    assert torch.equal(dst[1][0][2], src[1][0][1]) and torch.equal(dst[1][1][2], src[1][1][1])
    assert not dst[0][1][:4].any() and not dst[1][1][3:].any()  # other blocks untouched
    start = layout.conv_offset(0)  # the conv section is [conv_dim, kernel - 1], the canonical order
    conv = torch.from_numpy(page[start : start + layout.conv_bytes].copy()).view(torch.bfloat16).view(48, 3)
    assert torch.equal(conv, src[0][0][3].transpose(0, 1))
    end = layout.conv_offset(0) + layout.conv_bytes
    assert not page[end : layout.layer_bytes].any()  # padding zeroed


def cuda_gdn_tensors(layout: StateLayout, num_blocks: int, seed: int):
    """vLLM CUDA's per-layer [conv "SD", ssm [HV, V, K]] as its model runner registers them: views of one page per
    block of a raw buffer, conv first, then ssm (as_strided, the page as block stride), filled with random bytes."""
    channels, inputs = layout.conv_shape
    heads, keys, values = layout.recurrent_shape
    page = layout.conv_bytes + layout.recurrent_bytes + 64  # vLLM pads a GDN page up to the attention page
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks * page,), dtype=torch.uint8, generator=g)
    conv = torch.as_strided(raw.view(torch.bfloat16), (num_blocks, inputs, channels), (page // 2, channels, 1))
    ssm = torch.as_strided(
        raw.view(torch.float32), (num_blocks, heads, values, keys), (page // 4, values * keys, keys, 1),
        layout.conv_bytes // 4,
    )  # fmt: skip
    return conv, ssm


def section(page: np.ndarray, start: int, num_bytes: int, dtype, shape) -> torch.Tensor:
    return torch.from_numpy(page[start : start + num_bytes].copy()).view(dtype).view(shape)


def test_cuda_recurrent_state_moves_transposed_through_a_checkpoint_page():
    layout = StateLayout(2, 4, 8, 4, 48, 4, "float32", "bfloat16")  # K = 8, V = 4: the transpose shows
    src = [cuda_gdn_tensors(layout, 5, seed) for seed in (1, 2)]
    page = np.full(layout.checkpoint_bytes, 0xFF, dtype=np.uint8)
    StateBlocks(layout, src, HVK).read((3, 1), page)
    for index, block in enumerate((3, 1)):  # the page holds the canonical [HV, K, V] and [conv_dim, kernel - 1]
        recurrent = section(page, layout.recurrent_offset(index), layout.recurrent_bytes, torch.int32, (4, 8, 4))
        assert torch.equal(recurrent, src[index][1][block].view(torch.int32).transpose(1, 2))
        conv = section(page, layout.conv_offset(index), layout.conv_bytes, torch.int16, (48, 3))
        assert torch.equal(conv, src[index][0][block].view(torch.int16).transpose(0, 1))
    assert not page[layout.conv_offset(0) + layout.conv_bytes : layout.layer_bytes].any()  # padding zeroed

    dst = [cuda_gdn_tensors(layout, 5, seed) for seed in (3, 4)]
    before = [(c.view(torch.int16).clone(), s.view(torch.int32).clone()) for c, s in dst]
    StateBlocks(layout, dst, HVK).write(page, (4, 2))
    for (conv, ssm), (conv_0, ssm_0), (conv_a, ssm_a), (into, out_of) in zip(dst, before, src, ((4, 3), (2, 1))):
        assert torch.equal(ssm[into].view(torch.int32), ssm_a[out_of].view(torch.int32))  # bytes equal, NaNs too
        assert torch.equal(conv[into].view(torch.int16), conv_a[out_of].view(torch.int16))
        others = [b for b in range(5) if b != into]
        assert torch.equal(ssm.view(torch.int32)[others], ssm_0[others])  # other blocks untouched
        assert torch.equal(conv.view(torch.int16)[others], conv_0[others])
    again = np.zeros_like(page)
    StateBlocks(layout, dst, HVK).read((4, 2), again)
    assert np.array_equal(again, page)  # page -> blocks -> page


def test_either_devices_blocks_give_one_checkpoint_of_one_state():
    """The same logical state S[h, k, v] as vLLM CPU keeps it (the [HV, V, K] spec's bytes read as [HV, K, V]) and as
    vLLM CUDA does ([HV, V, K] in memory) is one checkpoint; with K == V only the order tells the two apart."""
    layout = StateLayout(1, 2, 4, 4, 24, 4, "float32", "bfloat16")
    state = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(5))  # [B, HV, K, V]
    conv = torch.randn(3, 3, 24, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    on_cpu = (conv, state.clone().view(3, 2, 4, 4))  # the spec's shape over [HV, K, V] bytes
    on_cuda = (conv, state.transpose(2, 3).contiguous())  # [HV, V, K] in memory
    pages = [np.zeros(layout.checkpoint_bytes, dtype=np.uint8) for _ in range(3)]
    StateBlocks(layout, [on_cpu], HKV).read((1,), pages[0])
    StateBlocks(layout, [on_cuda], HVK).read((1,), pages[1])
    StateBlocks(layout, [on_cuda], HKV).read((1,), pages[2])  # the wrong order: same shapes, another state
    assert np.array_equal(pages[0], pages[1]) and not np.array_equal(pages[0], pages[2])
    into = (torch.zeros_like(conv), torch.zeros(3, 2, 4, 4))
    StateBlocks(layout, [into], HVK).write(pages[0], (2,))
    assert torch.equal(into[1][2], on_cuda[1][1])


def test_unknown_state_layouts_are_refused():
    assert recurrent_order("0.32", "cpu") == HKV and recurrent_order("0.26", "cuda") == HVK
    for minor, device in (("0.33", "cuda"), ("0.25", "cpu"), ("0.26", "rocm")):
        with pytest.raises(UnsupportedHybrid, match=f"not vLLM {minor} on {device}.*--kv-transfer-config unset"):
            check_hybrid_setup(minor, device, 640, 640, allow_untested=True)  # allowing untested runs is not enough
    layout = StateLayout(1, 4, 8, 4, 48, 4, "float32", "bfloat16")
    with pytest.raises(ValueError, match="unknown GDN recurrent state order"):
        StateBlocks(layout, [cuda_gdn_tensors(layout, 2, 1)], "VHK")
    conv, ssm = cuda_gdn_tensors(layout, 2, 1)
    as_hkv = ssm.flatten(2).unflatten(2, (8, 4))  # [B, HV, K, V]: not the CUDA spec's shape
    with pytest.raises(ValueError, match=r"not vLLM's \[B, 4, 4, 8\]"):
        StateBlocks(layout, [(conv, as_hkv)], HVK)
    with pytest.raises(ValueError, match="torch.int32, the checkpoint's is float32"):
        StateBlocks(layout, [(conv, ssm.view(torch.int32))], HVK)
    with pytest.raises(ValueError, match="a checkpoint page on meta"):
        StateBlocks(layout, [(conv, ssm)], HVK).write(torch.empty(layout.checkpoint_bytes, dtype=torch.uint8,
                                                                   device="meta"), (0,))  # fmt: skip


def test_recurrent_dtype_is_the_one_vllm_resolved():
    assert recurrent_dtype_of("auto", "bfloat16") == "bfloat16"  # vLLM's "auto": the model's dtype
    assert recurrent_dtype_of("float32", "bfloat16") == "float32"
    text = SimpleNamespace(**TINY_TEXT)
    bf16, fp32 = state_layout_of(text, "bfloat16", 6, "bfloat16"), state_layout_of(text, "bfloat16", 6)
    assert bf16.recurrent_dtype == "bfloat16" and fp32.recurrent_dtype == "float32"
    assert bf16.fingerprint() != fp32.fingerprint()  # checkpoints of one are never read as the other's


def test_state_tensors_of_another_layout_are_refused():
    layout = StateLayout(2, 4, 8, 8, 48, 4, "float32", "bfloat16")
    other = dataclasses.replace(layout, num_value_heads=2)
    with pytest.raises(ValueError, match="ssm state"):
        StateBlocks(other, [gdn_tensors(layout, 3, s) for s in (1, 2)], HKV)
    with pytest.raises(ValueError, match="GDN layers"):
        StateBlocks(layout, [gdn_tensors(layout, 3, 1)], HKV)


def tiny_vllm_config(tp_size: int = 1, ssm_dtype: str = "float32"):
    """The parts of a VllmConfig the hybrid set-up reads, for the tests' tiny Qwen3-Next in bf16 (its recurrent state
    in float32, as vLLM CPU sets it)."""
    model = SimpleNamespace(dtype="torch.bfloat16", hf_text_config=SimpleNamespace(**TINY_TEXT))
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
        cache_config=SimpleNamespace(mamba_ssm_cache_dtype=ssm_dtype),
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="reads vLLM's version and platform")
def test_the_connectors_setup_of_a_hybrid_from_vllms_objects():
    kv_cache_config = qwen3_next_groups()
    groups = hybrid_groups(kv_cache_config)
    config = SimpleNamespace(chunk_tokens=640, allow_untested_vllm=False)
    setup = HybridSetup.of(groups, tiny_vllm_config(), kv_cache_config, config, 640)
    assert setup.groups == groups and setup.num_attention_layers == 2  # model.layers.3 and 7: the pages' layers
    assert setup.state_layout == state_layout_of(SimpleNamespace(**TINY_TEXT), "bfloat16", 6)
    assert setup.recurrent_order == HKV  # vLLM CPU's
    assert attention_group(setup) == 3 and attention_group(None) == 0
    auto = HybridSetup.of(groups, tiny_vllm_config(ssm_dtype="auto"), kv_cache_config, config, 640)
    assert auto.state_layout.recurrent_dtype == "bfloat16"  # vLLM's "auto": the model's dtype, as its blocks hold it
    with pytest.raises(UnsupportedHybrid, match="chunk_tokens to 640"):
        HybridSetup.of(
            groups,
            tiny_vllm_config(),
            kv_cache_config,
            SimpleNamespace(chunk_tokens=256, allow_untested_vllm=False),
            640,
        )
    with pytest.raises(UnsupportedHybrid, match="tensor-parallel-size 1"):
        HybridSetup.of(groups, tiny_vllm_config(tp_size=2), kv_cache_config, config, 640)


def test_the_gdn_layers_state_goes_to_the_worker_and_the_attention_kv_to_the_pages():
    groups = hybrid_groups(qwen3_next_groups())
    layout = StateLayout(6, 4, 8, 8, 48, 4, "float32", "bfloat16")
    setup = HybridSetup(groups, 2, layout, HKV)
    states = {name: gdn_tensors(layout, 3, seed) for seed, name in enumerate(groups.state_layers)}
    attention = {f"model.layers.{i}.self_attn.attn": torch.zeros(3, 2) for i in (3, 7)}
    kv_caches = {**{name: state[1] for name, state in states.items()}, **attention}
    forward_context = {name: SimpleNamespace(kv_cache=list(state)) for name, state in states.items()}
    blocks, left = setup.take_states(kv_caches, forward_context)
    assert left == attention and blocks.layout == layout
    page = np.zeros(layout.checkpoint_bytes, dtype=np.uint8)
    blocks.read((1,) * 6, page)  # every GDN layer's block 1, in model order
    conv = torch.from_numpy(page[layout.conv_offset(5) :][: layout.conv_bytes].copy()).view(torch.bfloat16)
    assert torch.equal(conv.view(48, 3), states["model.layers.6.linear_attn"][0][1].transpose(0, 1))
    del forward_context["model.layers.5.linear_attn"]
    with pytest.raises(UnsupportedKVLayout, match="model.layers.5.linear_attn"):
        setup.take_states(kv_caches, forward_context)


def test_kvshare_up_gives_vllm_what_a_hybrid_needs(tmp_path):
    config = {"architectures": ["Qwen3NextForCausalLM"], "torch_dtype": "bfloat16"}
    config.update(TINY_TEXT, layer_types=["linear_attention"] * 3 + ["full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    settings = hybrid_settings(str(tmp_path), "cpu")
    assert (settings.block_size, settings.chunk_tokens, settings.max_num_batched_tokens) == (640, 640, 640)
    assert "--mamba-cache-mode align" in settings.describe()
    argv = vllm_server_command(
        VllmServerConfig(model=str(tmp_path), port=8000, pool_socket="/tmp/p.sock", mamba_cache_mode="align")
    ).argv
    assert argv[argv.index("--mamba-cache-mode") + 1] == "align"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert hybrid_settings(str(tmp_path), "cpu") is None
