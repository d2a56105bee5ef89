"""The connector's guards without a vLLM server: fp8 KV through the layout path (bytes in == bytes out),
the layout fingerprint and dtype in the namespace, models with state other than attention KV."""

import dataclasses
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvshare.integrations.vllm.block_copy import CpuBlockCopier
from kvshare.integrations.vllm.guards import LayoutFingerprint, allocation_of, non_attention_state
from kvshare.integrations.vllm.layout import (
    UnsupportedKVLayout,
    as_bits,
    detect_layout,
    gather_tokens,
    scatter_tokens,
    slot_indices,
)
from kvshare.integrations.vllm.paged_tensors import BACKENDS, empty_layer, fill_random_
from kvshare.integrations.vllm.tensor_parallel import head_slice
from kvshare.keys import Namespace, namespace_digest

L, B, N, H, D = 2, 8, 32, 4, 64
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("order", sorted(BACKENDS))
@pytest.mark.parametrize("storage", [torch.uint8, FP8], ids=["uint8-as-vllm-allocates", "float8"])
def test_fp8_kv_moves_bit_for_bit_through_every_layout(order, storage):
    """Blocks -> pages -> other blocks, by whole-block numpy copies and by the token scatter/gather, for
    every memory order: every byte (NaN and inf patterns of e4m3 included) arrives unchanged."""
    src = [fill_random_(empty_layer(order, B, N, H, D, storage, "cpu"), seed=i) for i in range(L)]
    dst = [empty_layer(order, B, N, H, D, storage, "cpu").zero_() for _ in range(L)]
    layout = detect_layout(BACKENDS[order], src[0], H, D, N, FP8)  # the pages are e4m3; vLLM's tensor may be uint8
    block_ids, C = [5, 2, 7, 3], 2 * N
    pages = np.zeros((2, L, 2, C, H, D), dtype=np.uint8)  # two canonical pages of two blocks each
    if order != "5d" and order != "padded":
        readers, writers = CpuBlockCopier(src, layout), CpuBlockCopier(dst, layout)
        readers.from_blocks(pages, 0, C, block_ids)
        writers.to_blocks(pages, 0, C, block_ids)
        readers.close(), writers.close()
        assert pages.any()
    else:  # the torch token path
        slots = slot_indices(0, 2 * C, block_ids, N, "cpu")
        for index in range(L):
            tokens = torch.zeros(2, 2 * C, H, D, dtype=torch.uint8)
            gather_tokens(src[index], layout, slots, tokens)
            scatter_tokens(dst[index], layout, tokens, slots)
    for got, want in zip(dst, src):
        got_k, got_v = layout.kv_views(as_bits(got))
        want_k, want_v = layout.kv_views(as_bits(want))
        assert torch.equal(got_k[block_ids], want_k[block_ids]) and torch.equal(got_v[block_ids], want_v[block_ids])


def test_fp8_head_slices_of_a_tensor_parallel_rank():
    """A TP=2 rank's two heads of fp8 KV go to (and come from) their place in all-head pages."""
    full = fill_random_(empty_layer("cpu_attn", B, N, H, D, torch.uint8, "cpu"), seed=3)
    heads = head_slice(H, 1, 2)
    rank = full[:, heads.heads].contiguous()
    layout = detect_layout("CPU_ATTN", rank, heads.num_heads, D, N, FP8)
    pages = np.zeros((1, 1, 2, N, H, D), dtype=np.uint8)
    copier = CpuBlockCopier([rank], layout, heads=heads.heads)
    copier.from_blocks(pages, 0, N, [4])
    copier.close()
    whole = CpuBlockCopier([full], detect_layout("CPU_ATTN", full, H, D, N, FP8))
    expected = np.zeros_like(pages)
    whole.from_blocks(expected, 0, N, [4])
    whole.close()
    assert np.array_equal(pages[..., 2:, :], expected[..., 2:, :]) and not pages[..., :2, :].any()


def test_a_float_tensor_is_not_taken_for_fp8():
    with pytest.raises(UnsupportedKVLayout, match="expected dtype"):
        detect_layout("CPU_ATTN", torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16), H, D, N, FP8)


FINGERPRINT = LayoutFingerprint("0.32", "cpu", "auto", "", 32, "bfloat16", "layer_outer")


def namespace(**changes):
    base = Namespace("tiny", "f" * 32, "bfloat16", 8, 2, 64, engine_family="vllm")
    return dataclasses.replace(base, **changes)


def test_dtype_and_layout_fingerprint_separate_namespaces():
    plain = namespace_digest(namespace())
    assert namespace_digest(namespace(kv_layout_id="")) == plain  # namespaces without one keep their digests
    ids = [
        FINGERPRINT,
        dataclasses.replace(FINGERPRINT, vllm_version="0.33"),
        dataclasses.replace(FINGERPRINT, block_size=64),
        dataclasses.replace(FINGERPRINT, allocation="block_outer"),
        dataclasses.replace(FINGERPRINT, device="cuda", attention_backend="FLASH_ATTN", kv_cache_layout="NHD"),
    ]
    digests = {namespace_digest(namespace(kv_layout_id=f.text())) for f in ids}
    assert len(digests) == len(ids) and plain not in digests
    fp8 = dataclasses.replace(FINGERPRINT, kv_dtype="float8_e4m3fn")
    assert namespace_digest(namespace(kv_dtype="float8_e4m3fn", kv_layout_id=fp8.text())) not in digests
    assert "tp" not in FINGERPRINT.text()  # any TP size reads the same pages
    FINGERPRINT.check_kind("cpu_attn")
    with pytest.raises(ValueError, match="expects"):
        FINGERPRINT.check_kind("flash_attn")


class FullAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MLAAttentionSpec(FullAttentionSpec):
    pass


def config_of(*specs, tensors=()):
    groups = [SimpleNamespace(kv_cache_spec=spec, layer_names=[]) for spec in specs]
    return SimpleNamespace(kv_cache_groups=groups, kv_cache_tensors=list(tensors))


def test_models_with_other_state_are_not_shared():
    assert non_attention_state(config_of(FullAttentionSpec())) is None
    assert non_attention_state(None) is None
    assert "hybrid" in non_attention_state(config_of(FullAttentionSpec(), MambaSpec()))
    assert "MambaSpec" in non_attention_state(config_of(MambaSpec()))
    assert "SlidingWindowSpec" in non_attention_state(config_of(SlidingWindowSpec(sliding_window=128)))
    assert "sliding-window" in non_attention_state(config_of(FullAttentionSpec(sliding_window=4096)))
    assert "MLAAttentionSpec" in non_attention_state(config_of(MLAAttentionSpec()))
    assert "packed" in non_attention_state(config_of(FullAttentionSpec(num_head_slots=1)))


def test_allocation_kinds():
    one = SimpleNamespace(layers=["l0"], layer_stride=0, block_stride=0)
    outer = SimpleNamespace(layers=["l0", "l1"], layer_stride=1 << 20, block_stride=4096)
    packed = SimpleNamespace(layers=["l0", "l1"], layer_stride=4096, block_stride=8192)
    assert allocation_of(config_of(tensors=[one, one])) == "per_layer"
    assert allocation_of(config_of(tensors=[outer])) == "layer_outer"
    assert allocation_of(config_of(tensors=[packed])) == "block_outer"


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's spec classes")
def test_vllms_own_specs():
    from vllm.v1.kv_cache_interface import FullAttentionSpec as Full
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_cache_interface import MambaSpec as Mamba

    full = Full(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    mamba = Mamba(block_size=32, shapes=((4, 64),), dtypes=(torch.float32,))
    plain = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], full)])
    hybrid = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["m0"], mamba)],
    )
    assert non_attention_state(plain) is None
    assert "MambaSpec" in non_attention_state(hybrid)
