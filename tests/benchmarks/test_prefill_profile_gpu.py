"""benchmarks/prefill_profile_gpu.py and its trace reading (prefill_profile_trace.py): the kernel categoriser over
both engines' kernel names, the CPU trace's self times, busy time, regions, a CPU dry run of the whole script and a
vLLM server that does not start."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from tests.benchmarks.loader import load_benchmark

# names as the H100 traces give them (shortened where the template arguments run on)
KERNELS = {
    # the built-in engine: torch eager kernels, vllm_flash_attn FA3
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "GEMM",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_cublas": "GEMM",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)": "GEMM",
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::Collective"
    "MainloopFwdSm90<2, cute::tuple<cute::C<1>>, cutlass::bfloat16_t>>>>(...)": "attention",
    "void flash::prepare_varlen_num_blocks_kernel(int, int, int, int const*)": "attention",
    "void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#2}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2> >(...)": "norm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)>": (
        "activation"
    ),
    "void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda(...)>": "KV write / copies",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>": "KV write / copies",
    "void at::native::index_elementwise_kernel<128, 4, ...>": "KV write / copies",
    "Memcpy DtoD (Device -> Device)": "KV write / copies",
    "void at::native::unrolled_elementwise_kernel<at::native::MulFunctor<float>, ...>": "elementwise other",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>": "other",
    # vLLM 0.26: its custom ops and torch.compile's triton kernels
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>": (
        "KV write / copies"
    ),
    "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(...)": "norm",
    "void vllm::rotary_embedding_kernel<c10::BFloat16, true>(...)": "rotary",
    "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, false>": "activation",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
    "triton_poi_fused_mul_silu_slice_1": "activation",
    "triton_poi_fused_add_2": "elementwise other",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_3": "norm",
    "triton_per_fused_add_4": "elementwise other",
    # CPU operators (the dry run)
    "aten::mm": "GEMM",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::cat": "KV write / copies",
    "vllm::unified_kv_cache_update": "KV write / copies",
    "aten::mul": "elementwise other",
    # no rule
    "some_kernel_nobody_knows": "other",
}


@pytest.fixture(scope="module")
def reader():
    return load_benchmark("prefill_profile_trace")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("prefill_profile_gpu")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_names_of_both_engines_fall_into_their_category(reader, name):
    """vLLM's reshape_and_cache_flash_kernel fails as "attention" when the reshape_and_cache rule is not first."""
    assert reader.category(name) == KERNELS[name]


def test_every_category_a_rule_names_is_shown(reader):
    assert {c for c, _ in reader.RULES} | {reader.OTHER} == set(reader.CATEGORIES)


def test_cpu_operators_count_their_self_time_and_kernels_their_whole_time(reader):
    """A parent operator's time less its child's (fails when the nesting is not taken out: 10 instead of 4)."""
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 2, "dur": 6, "pid": 1, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 20, "dur": 5, "pid": 1, "tid": 1},
            {"ph": "X", "cat": "kernel", "name": "nvjet_x", "ts": 3, "dur": 4, "pid": 0, "tid": 7},
            {"ph": "X", "cat": "kernel", "name": "silu_kernel", "ts": 5, "dur": 4, "pid": 0, "tid": 8},
        ]
    }
    cpu = {e["name"]: e["self"] for e in reader.trace_events(trace, on_gpu=False)}
    assert cpu == {"aten::linear": 4, "aten::addmm": 6, "aten::mul": 5}
    gpu = reader.trace_events(trace, on_gpu=True)
    assert [(e["name"], e["self"]) for e in gpu] == [("nvjet_x", 4), ("silu_kernel", 4)]
    assert reader.busy_us(gpu) == 6  # 3..9: the overlap counted once
    summary = reader.summarise(gpu, wall_s=20e-6, gemm_flops=4e6)
    assert summary["categories"]["GEMM"]["count"] == 1 and summary["categories"]["activation"]["share"] == 0.5
    assert summary["span_ms"] == pytest.approx(6e-3) and summary["gemm_tflops"] == pytest.approx(1.0)  # 4 MFLOP in 4 us


def test_each_kernel_goes_to_the_innermost_region_open_where_it_was_launched(reader):
    """Ranges that start together: the inner one owns the launch (fails when the sweep opens inner before outer)."""
    ann = {"ph": "X", "cat": "user_annotation", "pid": 1, "tid": 1}
    run = {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "dur": 1}
    kernel = {"ph": "X", "cat": "kernel", "pid": 0, "tid": 7, "dur": 5}
    trace = {
        "traceEvents": [
            {**ann, "name": "region:MLP (act, mul)", "ts": 100, "dur": 50},
            {**ann, "name": "region:linear", "ts": 100, "dur": 10},
            {**ann, "name": "other annotation", "ts": 120, "dur": 5},
            {**run, "ts": 100, "args": {"correlation": 1}},  # inside linear, inside MLP
            {**run, "ts": 121, "args": {"correlation": 2}},  # inside MLP only (the other range is no region)
            {**run, "ts": 200, "args": {"correlation": 3}},  # outside every range
            {**kernel, "name": "nvjet_a", "ts": 300, "args": {"correlation": 1}},
            {**kernel, "name": "silu_kernel", "ts": 310, "args": {"correlation": 2}},
            {**kernel, "name": "add_kernel", "ts": 320, "args": {"correlation": 3}},
            {**kernel, "name": "no_launch_kernel", "ts": 330, "args": {}},
        ]
    }
    events = reader.trace_events(trace, on_gpu=True)
    reader.assign_regions(trace, events)
    assert {e["name"]: e["region"] for e in events} == {
        "nvjet_a": "linear",
        "silu_kernel": "MLP (act, mul)",
        "add_kernel": reader.UNANNOTATED,
        "no_launch_kernel": reader.UNANNOTATED,
    }
    regions = reader.by_region(events)
    assert regions["linear"]["categories"] == {"GEMM": pytest.approx(5e-3)}
    assert regions[reader.UNANNOTATED]["count"] == 2 and regions["linear"]["share"] == 0.25


def test_the_cpu_dry_run_writes_both_tables_inputs(bench, reader, tmp_path, capsys):
    out = tmp_path / "pp"
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--tokens", "64", "--out", str(out), "--no-vllm"]) == 0
    result = json.loads((out / "prefill_profile.json").read_text())
    kv = result["engines"]["kvshare"]
    assert set(kv["categories"]) == set(reader.CATEGORIES) and kv["categories"]["GEMM"]["count"] > 0
    assert len(kv["wall_s"]) == 2 and kv["top"] and result["flops"]["gemm"] < result["flops"]["prefill"]
    assert (out / "kvshare_trace.json.gz").exists() and "GEMM" in capsys.readouterr().out
    # the model's parts, found through the ranges around them; the instrumentation is gone afterwards
    assert {"linear", "attention", "norm", "rotary", "KV write", "MLP (act, mul)"} <= set(kv["regions"])
    assert kv["regions"]["linear"]["categories"]["GEMM"] > 0
    import kvshare.engine.model as model

    assert model.apply_rope.__name__ == "apply_rope" and model.write_kv.__name__ == "write_kv"


def test_a_vllm_server_that_exits_is_reported_and_the_run_goes_on(bench, tmp_path):
    """No model there (and no vLLM in this interpreter): the server exits, the row says so (fails, raising, when
    profile_vllm lets the error out instead of recording it)."""
    args = argparse.Namespace(
        tokens=64,
        model_dir=str(tmp_path / "none"),
        vllm_python=sys.executable,
        device="cpu",
        vllm_timeout=60.0,
        request_timeout=5.0,
    )
    row = bench.profile_vllm(args, str(tmp_path), None)
    assert "exited" in row["error"] and "trace" not in row and "wall_s" not in row
