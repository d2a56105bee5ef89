"""benchmarks/vllm_hybrid_gpu.sh without a GPU: its check step is a pytest command that selects the GPU test of the
GDN state's move on vLLM CUDA."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from tests.benchmarks.loader import ROOT


def test_the_check_step_runs_the_gpu_test_of_the_state_move(tmp_path):
    """Fails when step 3 is missing, or its command selects no test (a wrong path, marks the test lacks)."""
    script = os.path.join(ROOT, "benchmarks", "vllm_hybrid_gpu.sh")
    env = dict(os.environ, DRY="1", OUT=str(tmp_path))
    done = subprocess.run(["bash", script, "3"], env=env, capture_output=True, text=True, timeout=30)
    argv = shlex.split(done.stdout.strip())
    assert done.returncode == 0 and argv[:3] == ["python3", "-m", "pytest"], done.stdout + done.stderr
    collect = [sys.executable, *argv[1:], "--collect-only"]
    listed = subprocess.run(
        collect, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120
    )
    tests = [line for line in listed.stdout.splitlines() if "::" in line]
    assert tests == ["tests/integrations/vllm/test_hybrid_cuda.py::test_b_resumes_from_as_checkpoint_and_answers_as_"
                     "its_own_cold_run"], listed.stdout + listed.stderr  # fmt: skip
