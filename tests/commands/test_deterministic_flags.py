"""--deterministic on serve, generate, up and bench: what each passes on, and what each refuses."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from kvshare.commands import serve


def kvshare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-P", "-m", "kvshare", *args],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def test_serve_maps_the_flags_onto_the_engine_config():
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    config = serve.engine_config(p.parse_args(["--deterministic", "--chunk-tokens", "16", "--grid-tokens", "64"]))
    assert config.deterministic and config.grid_len == 64
    default = serve.engine_config(p.parse_args([]))
    assert not default.deterministic and default.grid_tokens is None


def test_generate_in_the_mode_says_so():
    result = kvshare(
        "generate",
        "--model",
        "tiny",
        "--prompt",
        "a prompt of a few chunks " * 3,
        "--max-tokens",
        "3",
        "--ignore-eos",
        "--chunk-tokens",
        "16",
        "--deterministic",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["deterministic"] is True


def test_a_grid_that_is_no_multiple_of_the_chunk_is_refused():
    result = kvshare(
        "generate", "--model", "tiny", "--prompt", "x", "--chunk-tokens", "16", "--deterministic", "--grid-tokens", "24"
    )
    assert (
        result.returncode == 2 and "multiple of chunk_tokens 16" in result.stderr and "Traceback" not in result.stderr
    )


def test_up_and_bench_refuse_the_mode_where_it_cannot_apply():
    result = kvshare("up", "--engine", "vllm", "--deterministic")
    assert result.returncode == 2 and "mode of the built-in engine" in result.stderr
    result = kvshare("bench", "ttft", "--replica", "http://127.0.0.1:9", "--deterministic")
    assert result.returncode == 2 and "replicas given by URL" in result.stderr
