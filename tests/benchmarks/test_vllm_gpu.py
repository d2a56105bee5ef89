"""benchmarks/vllm_gpu.py and vllm_gpu_all.sh without vLLM or a GPU: what they refuse, and that every step of the
GPU plan is a command line the driver accepts."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess

import pytest

from tests.benchmarks.loader import ROOT, load_benchmark


def driver():
    return load_benchmark("vllm_gpu")


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is not None, reason="lmcache is importable here")
def test_lmcache_setup_refuses_cleanly_where_lmcache_is_not_importable(tmp_path, capsys):
    """Fails when the LMCache setup starts anything (or dies with a traceback) before it knows lmcache imports."""
    code = driver().main(["--setup", "lmcache-mp", "--model-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "lmcache_install.sh" in err and "Nothing was started" in err
    assert not (tmp_path / "out").exists()


def test_a_mode_its_setup_cannot_measure_is_refused(capsys):
    with pytest.raises(SystemExit):
        driver().parse_args(["--setup", "vllm-offloading", "--modes", "load", "--model-dir", "m", "--out", "o"])
    assert "measures ttft, not load" in capsys.readouterr().err
    args = driver().parse_args(["--setup", "store-cost", "--model-dir", "m", "--out", "o"])
    assert args.modes == ["store-cost"]


def test_every_step_of_the_gpu_plan_is_a_command_the_driver_accepts(tmp_path):
    """Fails when a step names a setup, a mode or a flag the driver does not have (found on the GPU otherwise)."""
    script = os.path.join(ROOT, "benchmarks", "vllm_gpu_all.sh")
    env = dict(os.environ, DRY="1", OUT=str(tmp_path))
    plan = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=30).stdout
    steps = [line.split()[0] for line in plan.splitlines() if line[:1].isdigit()]
    assert steps == [str(n) for n in range(1, len(steps) + 1)] and len(steps) >= 7
    setups = set()
    for n in steps:
        done = subprocess.run(["bash", script, n], env=env, capture_output=True, text=True, timeout=30)
        argv = shlex.split(done.stdout.strip())
        assert done.returncode == 0 and argv[:2] == ["python3", "benchmarks/vllm_gpu.py"], done.stdout + done.stderr
        args = driver().parse_args(argv[2:])
        setups.add(args.setup)
    assert setups == set(driver().SETUPS)  # every setup runs somewhere in the plan


def test_an_80_gb_card_runs_the_8b_steps_at_32k(tmp_path):
    """Two 8B replicas with a 128k prompt's KV do not fit 80 GB: there the plan's 8B steps take 32k lengths, a
    matching --max-model-len and 10 GiB of KV (fails without the card check: 24G and 131072 on an H100)."""
    script = os.path.join(ROOT, "benchmarks", "vllm_gpu_all.sh")
    fake = tmp_path / "bin"
    fake.mkdir()

    def step4(card_mib: int) -> list[str]:
        (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho {card_mib}\n")
        (fake / "nvidia-smi").chmod(0o755)
        env = dict(os.environ, DRY="1", OUT=str(tmp_path), PATH=f"{fake}:{os.environ['PATH']}")
        env.pop("L8", None)
        done = subprocess.run(["bash", script, "4"], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return shlex.split(done.stdout.strip())

    small, large = driver().parse_args(step4(81559)[2:]), driver().parse_args(step4(143771)[2:])
    assert (small.lengths, small.max_model_len, small.kv_cache_memory_bytes) == ([32768], 33024, "10G")
    assert large.lengths == [32768, 131072] and large.kv_cache_memory_bytes == "24G"


def test_replicas_that_share_a_gpu_split_it_also_when_their_kv_size_is_given():
    """Fails when a replica config of the driver keeps its private ``shares_gpu`` flag (a TypeError on CPU), or
    when a replica given its KV size keeps vLLM's default share: vLLM refuses to start unless that share of the
    card is free, which it is not beside another replica."""
    from types import SimpleNamespace

    bench = driver()

    def config(*flags, **fields):
        args = bench.parse_args(["--setup", "store-cost", "--model-dir", "m", "--out", "o", *flags])
        return bench.server_config(SimpleNamespace(args=args, served="m"), 8001, "A", **fields)

    assert config(shares_gpu=True).gpu_memory_utilization == 0.45
    assert config(shares_gpu=False).gpu_memory_utilization is None
    assert config("--device", "cpu", shares_gpu=True).gpu_memory_utilization is None
    sized = config("--kv-cache-memory-bytes", "24G", shares_gpu=True)
    assert sized.gpu_memory_utilization == 0.45 and "--kv-cache-memory-bytes=24G" in sized.extra_args


def test_every_replica_of_a_hybrid_model_gets_what_its_state_needs(tmp_path):
    """Qwen3.5-27B's text config: vLLM's block of 784 tokens on CUDA as block, chunk and step, and align mode, for a
    replica with kvshare's connector and for one with LMCache's alike (LMCache's MP mode needs the same)."""
    import json
    from types import SimpleNamespace

    text = dict(
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_conv_kernel_dim=4, head_dim=256, num_key_value_heads=4, num_attention_heads=24, hidden_size=5120,
        layer_types=["linear_attention"] * 3 + ["full_attention"], dtype="bfloat16",
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    bench = driver()
    args = bench.parse_args(["--setup", "lmcache-mp", "--model-dir", str(tmp_path), "--out", "o"])
    for fields in ({"pool_socket": "/tmp/p.sock"}, {"lmcache_mp_port": 5555}):
        config = bench.server_config(SimpleNamespace(args=args, served="m"), 8001, "A", **fields)
        assert (config.block_size, config.max_num_batched_tokens, config.mamba_cache_mode) == (784, 784, "align")
        assert config.chunk_tokens == 784
