"""kvshare.memory_fit: up refuses replicas whose memory cannot fit, and says so with the numbers."""

import logging

import pytest

from kvshare import memory_fit, preflight
from kvshare.children import describe_exit
from kvshare.errors import UserError
from kvshare.launch import Cluster, ClusterConfig, free_port_block

GIB = 1 << 30


@pytest.fixture
def machine(monkeypatch):
    """A machine of 23.5 GiB without a GPU (MemAvailable 20 GiB), as a new user's laptop."""
    monkeypatch.setattr(preflight, "memory_limit", lambda: (int(23.5 * GIB), "this machine's memory (MemTotal)"))
    monkeypatch.setattr(preflight, "meminfo", lambda field, path="/proc/meminfo": 20 * GIB)
    monkeypatch.setattr(memory_fit, "_gpu_totals", lambda: {})


def preflight_of(**config) -> None:
    Cluster(ClusterConfig(port=free_port_block(4), **config))._preflight()


def test_replicas_whose_weights_exceed_the_machine_are_refused_with_the_numbers(machine):
    """Fails when up starts two 8B-shape replicas on a 23.5 GiB machine: the OOM killer then ends one, and up says
    only "killed by SIGKILL"."""
    with pytest.raises(UserError) as err:
        preflight_of(model="qwen3-8b", num_replicas=2)
    message = str(err.value)
    assert "2 replica(s) of qwen3-8b on CPU" in message and "OOM" in message, message
    assert "15.26 GiB of weights" in message and "23.50 GiB" in message, message


def test_what_requests_may_fill_later_is_a_warning_with_the_numbers(machine, caplog):
    """One 8B-shape replica starts (its weights fit); its KV for a whole context, its local cache and the pool
    may not, so up warns, naming them and the flags that bound them."""
    with caplog.at_level(logging.WARNING, logger="kvshare.memory_fit"):
        preflight_of(model="qwen3-8b", num_replicas=1)
    text = caplog.text
    assert "OOM killer" in text and "262144-token context" in text and "--max-model-len" in text, text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvshare.memory_fit"):
        preflight_of(model="tiny", num_replicas=2)
    assert "OOM" not in caplog.text  # the default cluster fits


def test_replicas_that_exceed_a_gpu_at_start_up_are_refused(machine, monkeypatch):
    """Two 32B-shape replicas on one 80 GiB GPU: 61 GiB of weights and 32 GiB of KV each, allocated as they start."""
    monkeypatch.setattr(memory_fit, "_gpu_totals", lambda: {0: 80 * GIB})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(UserError, match="2 replica\\(s\\) of qwen3-32b on GPU 0 need about"):
        preflight_of(model="qwen3-32b", num_replicas=2, device="cuda", pool_size=None)
    preflight_of(model="qwen3-8b", num_replicas=1, device="cuda", pool_size=None)  # 15 + 36 GiB: fits
    preflight_of(
        model="qwen3-32b", num_replicas=1, device="cuda", pool_size=None, replica_args=("--max-model-len=32k",)
    )


def test_a_child_the_oom_killer_ended_is_said_to_be_its_with_the_memory(monkeypatch):
    """Fails when up says only "killed by SIGKILL" where the kernel's OOM killer ended a child (its count in
    /proc/vmstat went up meanwhile); a SIGKILL from elsewhere, or from the supervisor itself, says no more."""
    from tests.test_supervisor import supervised

    kills = [4]
    monkeypatch.setattr(memory_fit, "oom_kills", lambda: kills[0])
    assert describe_exit(-9, 4) == "killed by SIGKILL" and describe_exit(-15, 3) == "killed by SIGTERM"
    kills[0] = 5
    text = describe_exit(-9, 4)
    assert text.startswith("killed by SIGKILL, by the kernel's OOM killer") and "available now" in text, text
    cluster, now, said, sup = supervised()
    kills[0] = 6
    cluster.processes["replica0"].returncode = -9
    sup.poll()
    assert said[-1].startswith("replica0 exited (killed by SIGKILL, by the kernel's OOM killer (1 kill(s) meanwhile"), (
        said
    )
    cluster.processes["pool"].returncode = -9  # no OOM kill since the last exit: someone else's SIGKILL
    sup.poll()
    assert said[-1].startswith("pool exited (killed by SIGKILL); starting"), said


def test_the_estimate_counts_the_weights_and_kv_a_replica_holds(tmp_path):
    from kvshare.engine.make_model import write_model_dir
    from kvshare.engine.presets import PRESETS

    directory = tmp_path / "tiny-dir"
    write_model_dir("tiny", str(directory))
    on_disk = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    memory = memory_fit.replica_memory(str(directory), ("--max-model-len", "4k", "--kv-dtype", "fp8"), "cpu")
    assert memory.weights == on_disk and memory.context == 4000
    config = PRESETS["tiny"].config
    assert memory.kv == 4000 * config.num_layers * 2 * config.num_kv_heads * config.head_dim  # fp8: a byte each
    preset = memory_fit.replica_memory("tiny", ("--dtype", "bfloat16", "--local-cache-size", "off"), "cpu")
    assert preset.weights == PRESETS["tiny"].num_parameters * 2 and preset.local_cache == 0
    assert abs(preset.weights * 2 - on_disk) < on_disk // 100  # float32 on disk: twice bf16's bytes, give or take


def test_a_replica_flag_the_estimate_cannot_read_is_left_to_the_replica(machine):
    """An unknown --kv-dtype is the replica's to refuse (it names the flag); the preflight does not crash on it."""
    preflight_of(model="qwen3-8b", num_replicas=2, replica_args=("--kv-dtype", "fp4"))
