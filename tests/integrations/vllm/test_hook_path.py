"""The vLLM package reads in hook order: one step's hooks run through at most four files of it.

A GPU step (under the fake CUDA) and a CPU step, each storing then loading a prompt, are traced:
every module of kvshare/integrations/vllm/ whose code runs must be a hook file (connector, scheduler,
worker, then gpu or cpu) or one of the plain modules beneath them that the package's ``__init__`` lists.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

import kvshare.integrations.vllm as package
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool
from kvshare.transfer.base import TransferConfig
from tests.integrations.vllm.staged_replica import Replica
from tests.transfer import fake_cuda

PACKAGE = Path(package.__file__).parent
HOOK_FILES = {"connector", "scheduler", "worker", "gpu", "cpu"}  # connector is the face (it imports vLLM)
BENEATH = {
    "prefetch",
    "gpu_prefetch",
    "cpu_prefetch",
    "hint_listener",
    "gpu_stores",
    "cpu_overlap",
    "paged_destination",
    "block_copy",
    "pool_pages",
    "tensor_parallel",
    "layout",
    "page_slices",
    "prompt_chunks",
    "leases",
    "metadata",
    "counters",
    "options",
    "stats",
    "identity",
    "guards",
    "compat",
}
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", chunk_tokens=32)
PROMPT = list(range(3, 3 + 4 * 32 + 5))


@pytest.fixture(scope="module")
def pool():
    with running_pool("1MiB", ("--extent-size", "128KiB")) as socket_path:
        yield socket_path


def modules_run(step) -> set[str]:
    """The package's modules whose functions run during ``step()`` (on any thread)."""
    seen: set[str] = set()

    def tracer(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if event == "call" and path.parent == PACKAGE:
            seen.add(path.stem)
        return None

    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        step()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return seen


def test_the_package_map_names_every_module():
    """Fails when a module is added to the package without a place in the hook-order map of its __init__."""
    listed = {line.split()[0] for line in package.__doc__.splitlines() if line.startswith("    ") and line.split()}
    modules = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules <= listed
    assert HOOK_FILES | BENEATH <= listed


@pytest.mark.parametrize("staged", [True, False], ids=["gpu", "cpu"])
def test_a_steps_hooks_cross_at_most_four_files_of_the_package(monkeypatch, pool, staged):
    """Fails on a layout where the worker's hooks reach the copies through more files (hooks.py, then
    worker.py, then staged_loads.py or staged_stores.py: six hook files on the GPU path)."""
    fake_cuda.install(monkeypatch, fake_cuda.FakeCuda())
    with PoolClient(pool, name="flush") as client:
        client.flush()
    transfer = TransferConfig(min_copy_bytes=4 << 10, staging_bytes=12 << 10)
    a, b = (
        Replica(
            pool, name, LAYOUT, "LBNHC", 32, 8, torch.device("cpu"), staged=staged, worker_kwargs={"transfer": transfer}
        )
        for name in ("A", "B")
    )
    try:
        a.fill(1)
        b.fill(2)
        outcomes = []
        run = modules_run(
            lambda: (
                a.step("a", PROMPT, list(range(17))),
                outcomes.append(b.step("b", PROMPT, list(range(31, 14, -1)))),
            )
        )
        assert outcomes[0].is_complete and outcomes[0].loaded_end == 4 * 32  # a store, then a load, ran
    finally:
        a.close(), b.close()
    assert run <= HOOK_FILES | BENEATH, f"modules outside the map: {sorted(run - HOOK_FILES - BENEATH)}"
    hook_files = run & HOOK_FILES | {"connector"}  # the Replica drives the sides as connector's hooks do
    assert len(hook_files) <= 4, sorted(hook_files)
    assert ("gpu" in run) == staged and ("cpu" in run) != staged
