"""Prompts of exact lengths with unique heads, for the byte-level tokenizer and a BPE one."""

from __future__ import annotations

import pytest

from kvshare.bench.workload import PromptFactory, WorkloadConfig, filler_vocabulary
from kvshare.engine.tokenizer import CHAT_TEMPLATE, Tokenizer

CHUNK = 256


@pytest.fixture(scope="module")
def byte_tok():
    return Tokenizer.byte_level(32768)


@pytest.fixture(scope="module")
def bpe_tok():
    """A small BPE (byte-level pre-tokenizer, merges learnt from English) with the ChatML template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (
        "the quick brown fox jumps over the lazy dog while the cache holds the state of every request "
        "and the pool shares it between replicas that never saw the prompt before "
    ) * 50
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|eos|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text], trainer)
    return Tokenizer(tok, {"eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE})


@pytest.mark.parametrize("which", ["byte_tok", "bpe_tok"])
@pytest.mark.parametrize("system_tokens", [0, 40])
def test_prompts_have_exact_lengths(request, which, system_tokens):
    tok = request.getfixturevalue(which)
    factory = PromptFactory(tok, WorkloadConfig(nonce="run1", system_tokens=system_tokens))
    for n in (100, 513, 2048):
        ids = factory.completion_prompt(n, f"t/{n}")
        assert len(ids) == n
        messages = factory.chat_messages(n, f"c/{n}")
        assert len(tok.apply_chat_template(messages)) == n


@pytest.mark.parametrize("which", ["byte_tok", "bpe_tok"])
def test_filler_words_round_trip(request, which):
    tok = request.getfixturevalue(which)
    words = filler_vocabulary(tok)
    assert len(words) >= 16
    assert tok.encode(tok.decode(words * 3)) == words * 3


def test_prompts_of_different_units_or_runs_differ_in_their_first_chunk(byte_tok):
    a = PromptFactory(byte_tok, WorkloadConfig(nonce="run1", system_tokens=100))
    b = PromptFactory(byte_tok, WorkloadConfig(nonce="run2", system_tokens=100))
    p1, p2, p3 = a.completion_prompt(1024, "u/0"), a.completion_prompt(1024, "u/1"), b.completion_prompt(1024, "u/0")
    # the shared system prompt is shared...
    assert p1[:100] == p2[:100] == p3[:100]
    # ...and the first chunk already differs, so no chunk key of one can match another's
    assert p1[:CHUNK] != p2[:CHUNK] and p1[:CHUNK] != p3[:CHUNK]
    # the same unit in the same run gives the same prompt (a factory is deterministic)
    assert a.completion_prompt(1024, "u/0") == p1


def test_chat_prompts_grow_by_appending(byte_tok):
    """A session's next turn extends the previous prompt token for token (what makes reuse possible)."""
    factory = PromptFactory(byte_tok, WorkloadConfig(nonce="run1"))
    messages = factory.chat_messages(600, "s/0")
    first = byte_tok.apply_chat_template(messages)
    longer = messages + [
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": factory.user_text(50, "s/0/1")},
    ]
    second = byte_tok.apply_chat_template(longer)
    assert second[: len(first)] == first and len(second) > len(first) + 50


def test_too_short_prompts_are_refused(byte_tok):
    factory = PromptFactory(byte_tok, WorkloadConfig(nonce="run1", system_tokens=50))
    with pytest.raises(ValueError, match="no room"):
        factory.completion_prompt(55, "x")
    with pytest.raises(ValueError):
        factory.chat_messages(20, "x")
