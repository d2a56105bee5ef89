import json
import subprocess
import sys


def test_plan_for_presets():
    out = subprocess.run(
        [sys.executable, "-m", "kvshare", "plan", "--model", "qwen3-32b", "--tokens", "131072", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    plan = json.loads(out)
    assert plan["bytes_per_token"] == 64 * 2 * 8 * 128 * 2  # 256 KiB per token
    assert plan["page_bytes"] == 64 << 20 and plan["kv_bytes"] == 32 << 30


def test_plan_for_a_model_directory(tmp_path):
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = subprocess.run(
        [sys.executable, "-m", "kvshare", "plan", "--model", str(tmp_path), "--tokens", "1000", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    plan = json.loads(out)
    assert plan["bytes_per_token"] == 2 * 2 * 2 * 16 * 2 and plan["pages"] == 4


def test_plan_unknown_model_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "kvshare", "plan", "--model", "no-such", "--tokens", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no-such" in proc.stderr


def test_plan_tokens_take_a_suffix():
    def tokens(text: str) -> int:
        out = subprocess.run(
            [sys.executable, "-m", "kvshare", "plan", "--model", "tiny", "--tokens", text, "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        return json.loads(out)["tokens"]

    assert (tokens("100k"), tokens("32K"), tokens("1.5m")) == (100_000, 32_768, 1_500_000)


def test_plan_reports_a_hybrids_kv_and_state_bytes():
    """Qwen3.5-27B: KV of its 16 attention layers only (64 KiB a token), and its 48 GDN layers' state (147 MiB)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvshare", "plan", "--model", "qwen3.5-27b", "--tokens", "131072"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "16 attention layers" in proc.stdout and "48 Gated DeltaNet layers" in proc.stdout
    out = subprocess.run(
        [sys.executable, "-m", "kvshare", "plan", "--model", "qwen3.5-27b", "--tokens", "131072", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    plan = json.loads(out)
    assert plan["layers"] == 16 and plan["bytes_per_token"] == 64 << 10 and plan["kv_bytes"] == 8 << 30
    assert plan["gdn_layers"] == 48 and plan["state_bytes"] == 153_944_064
    assert plan["recurrent_shape"] == [48, 128, 128] and plan["conv_shape"] == [10240, 3]
