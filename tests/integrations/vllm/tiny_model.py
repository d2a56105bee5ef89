"""The model the vLLM tests and benchmarks run: the project's ``tiny`` preset as a Hugging Face directory.

``kvshare make-model tiny`` writes it (Llama, 8 layers, hidden 256, 4 heads of 64,
2 KV heads, float32, byte-level tokenizer); vLLM loads it like any local model.
Set KVSHARE_VLLM_TEST_MODEL to a model directory to run the tests on another model.
"""

from __future__ import annotations

import os
import subprocess
import sys

VOCAB_SIZE = 260  # the tiny preset's byte tokenizer: 256 bytes and 4 special tokens


def make_model_dir(path: str) -> str:
    """A model directory for the tests: $KVSHARE_VLLM_TEST_MODEL when set, else the tiny preset written to ``path``."""
    given = os.environ.get("KVSHARE_VLLM_TEST_MODEL")
    if given:
        return given
    if not os.path.exists(os.path.join(path, "config.json")):
        subprocess.run(
            [sys.executable, "-m", "kvshare", "make-model", "tiny", "--out", path],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return path
