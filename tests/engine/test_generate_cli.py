"""`kvshare generate` and `kvshare make-model` from the command line."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys


def kvshare(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvshare", *args], capture_output=True, text=True, timeout=120, check=check
    )


def test_generate_json_without_pool(tiny_dir, tmp_path):
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, SamplingParams

    prompt = tmp_path / "p.txt"
    prompt.write_text("Tell me a story about a cat.")
    out = json.loads(
        kvshare(
            "generate",
            "--model",
            tiny_dir,
            "--pool",
            "off",
            "--prompt-file",
            str(prompt),
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ).stdout
    )
    engine = Engine(EngineConfig(model=tiny_dir))
    expected = [
        e.token_id
        for e in engine.generate(
            engine.tokenizer.encode(prompt.read_text()), SamplingParams(max_tokens=6, ignore_eos=True)
        )
    ]
    assert out["token_ids"] == expected
    assert out["text"] == engine.tokenizer.decode(expected)
    assert out["provenance"] == {"local_tokens": 0, "pool_tokens": 0, "computed_tokens": 28}
    assert out["finish_reason"] == "length" and out["ttft_s"] > 0


def test_generate_refuses_bad_input_with_a_message(tmp_path):
    result = kvshare("generate", "--model", str(tmp_path / "missing"), "--prompt", "x", check=False)
    assert result.returncode == 2 and "missing: no such directory, and not a preset" in result.stderr  # as up says it
    result = kvshare("generate", "--model", "tiny", "--prompt-file", str(tmp_path / "none.txt"), check=False)
    assert result.returncode == 2 and "cannot read the prompt" in result.stderr


def test_make_model_prints_its_fingerprint(tmp_path, tiny_dir):
    from kvshare.engine.weights import model_dir_fingerprint

    out = json.loads(kvshare("make-model", "tiny", "--out", str(tmp_path / "m")).stdout)
    assert out["weights_fingerprint"] == model_dir_fingerprint(tiny_dir)


def test_make_model_no_weights_writes_the_same_files_but_the_weights(tmp_path, tiny_dir):
    """A GPU shape for vLLM's --load-format dummy: its config and tokenizer, no 65 GB of weights and no question
    asked on a machine without a GPU. Fails when make-model has no --no-weights (it then writes or refuses)."""
    full = pathlib.Path(tiny_dir)
    kvshare("make-model", "tiny", "--out", str(tmp_path / "t"), "--no-weights")
    written = sorted(p.name for p in (tmp_path / "t").iterdir())
    assert written == sorted(p.name for p in full.iterdir() if p.suffix != ".safetensors")
    assert all((tmp_path / "t" / name).read_bytes() == (full / name).read_bytes() for name in written)
    kvshare("make-model", "qwen3-32b", "--out", str(tmp_path / "b"), "--no-weights")
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["num_hidden_layers"] == 64 and not list((tmp_path / "b").glob("*.safetensors"))


def test_make_model_and_generate_a_hybrid(tmp_path):
    """The Qwen3.5 hybrid from the command line: make-model writes it, generate runs it (no pool)."""
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, SamplingParams

    out = tmp_path / "qwen3.5-tiny"
    kvshare("make-model", "qwen3.5-tiny", "--out", str(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5"
    done = kvshare(
        "generate", "--model", str(out), "--prompt", "A hybrid model", "--max-tokens", "5", "--ignore-eos", "--json"
    )
    result = json.loads(done.stdout)
    engine = Engine(EngineConfig(model=str(out)))
    ids = engine.tokenizer.encode("A hybrid model")
    expected = [e.token_id for e in engine.generate(ids, SamplingParams(max_tokens=5, ignore_eos=True))]
    assert result["token_ids"] == expected and result["provenance"]["computed_tokens"] == len(ids)
