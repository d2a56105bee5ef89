"""The Qwen3 presets' BPE: 131072 tokens, the byte tokenizer's special ids, the same files on every make-model run."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvshare.engine.bpe import PRESET_BPES, PRESET_VOCAB_SIZE, preset_bpe_json, train_bpe, train_preset_bpe
from kvshare.engine.loader import load_tokenizer
from kvshare.engine.make_model import write_tokenizer_files
from kvshare.engine.presets import get_preset
from kvshare.engine.tokenizer import BOS_ID, EOS_ID, IM_END_ID, IM_START_ID, Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, bakoti zuresa"}]


def _digests(path: str) -> dict[str, str]:
    return {n: hashlib.sha256(open(os.path.join(path, n), "rb").read()).hexdigest() for n in sorted(os.listdir(path))}


def test_make_model_writes_the_same_tokenizer_files_every_time(tmp_path):
    """make-model determinism for the BPE presets (the weights' half: test_presets.py)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for out in (a, b):
        os.makedirs(out)
        write_tokenizer_files("qwen3-8b", out)
    assert _digests(a) == _digests(b)
    assert set(_digests(a)) == {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    }


def test_the_preset_bpe_is_large_and_keeps_the_byte_tokenizers_ids(tmp_path):
    write_tokenizer_files("qwen3-32b", str(tmp_path))
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.vocab_size == PRESET_VOCAB_SIZE >= 100_000
    assert tok.vocab_size <= get_preset("qwen3-32b").config.vocab_size
    assert [tok._tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")] == [
        BOS_ID,
        EOS_ID,
        IM_START_ID,
        IM_END_ID,
    ]
    assert tok.encode("a") == [97] and tok.decode(tok.encode("Hello there, 東京!")) == "Hello there, 東京!"
    text = tok.decode(list(range(120_000, 120_300)))  # late merges: whole generated words
    assert len(tok.encode(text)) < len(text) / 4  # merged words, not bytes
    ids = tok.apply_chat_template(MESSAGES)
    assert ids[0] == IM_START_ID and IM_END_ID in ids
    assert load_tokenizer("qwen3-8b").apply_chat_template(MESSAGES) == ids  # the in-memory preset: the same ids
    assert load_tokenizer("tiny").vocab_size == 260  # the CPU preset keeps the byte tokenizer


def test_transformers_loads_the_preset_bpe_and_renders_chats_alike(tmp_path):
    """vLLM serves the same directory: transformers' AutoTokenizer must give the same ids and chat prompt."""
    transformers = pytest.importorskip("transformers")
    write_tokenizer_files("qwen3-8b", str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_dir(str(tmp_path))
    text = "The café's 12345 naïve  résumés, (don't) stop: 東京 " * 3
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    rendered = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    rendered = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    assert list(rendered) == ours.apply_chat_template(MESSAGES)


def test_training_is_deterministic_at_a_small_size():
    a, b = train_bpe(vocab_size=1000, num_words=2000), train_bpe(vocab_size=1000, num_words=2000)
    assert a.to_str() == b.to_str() and a.get_vocab_size() == 1000


def test_the_qwen3_5_presets_bpe_has_their_vocabulary_and_the_same_special_ids(tmp_path):
    write_tokenizer_files("qwen3.5-27b", str(tmp_path))
    tok = Tokenizer.from_dir(str(tmp_path))
    assert tok.vocab_size == PRESET_BPES["bpe248k"].vocab_size == get_preset("qwen3.5-27b").config.vocab_size
    assert [tok._tok.token_to_id(t) for t in ("<|bos|>", "<|im_end|>")] == [BOS_ID, IM_END_ID]
    assert tok.decode(tok.encode("Hello there, 東京!")) == "Hello there, 東京!"
    text = tok.decode(list(range(240_000, 240_100)))  # the last merges are whole generated words too
    assert len(tok.encode(text)) < len(text) / 4


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(PRESET_BPES))
def test_training_the_recipe_gives_the_shipped_file(kind):
    """The shipped file is what the recipe trains (about 15 s; 60 s for bpe248k): a change to either shows here."""
    assert train_preset_bpe(kind).to_str() == preset_bpe_json(kind)
