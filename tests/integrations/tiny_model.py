"""A small random Llama as a normal Hugging Face directory, for the vLLM tests and benchmarks.

Same shape as the project's ``tiny`` preset (8 layers, hidden 256, 4 heads of 64,
2 KV heads, float32) with a byte-level BPE tokenizer trained offline. Weights are
drawn with a large init std (0.5): with the default 0.02 a tiny model repeats one
token, and equality tests need varied, context-dependent outputs.

    python -m tests.integrations.tiny_model DIR     # writes the model into DIR

Set KVSHARE_VLLM_TEST_MODEL to a model directory (e.g. one ``kvshare make-model tiny``
wrote) to run the tests on it instead.
"""

from __future__ import annotations

import os
import sys

VOCAB_SIZE = 512
MAX_POSITIONS = 32768
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _training_text() -> list[str]:
    words = (
        "pool page chunk lease replica cache prefix token layer head kernel stream copy commit "
        "reserve lookup router session tenant salt hash block tensor memory host device model"
    ).split()
    lines = []
    for i in range(2000):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) + f" {i}.")
    return lines


def build_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 8,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_tiny_model(path: str, seed: int = 0, init_std: float = 0.5) -> str:
    """Write the model and tokenizer into ``path`` (created); returns ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    build_tokenizer(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_model_dir(path: str) -> str:
    """A model directory for the tests: $KVSHARE_VLLM_TEST_MODEL when set, else built into ``path``."""
    given = os.environ.get("KVSHARE_VLLM_TEST_MODEL")
    if given:
        return given
    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.integrations.tiny_model DIR")
    print(build_tiny_model(sys.argv[1]))
