"""The large presets' tokenizers: byte-level BPEs trained with ``tokenizers`` on generated text.

A 260-token byte tokenizer makes tokenization nearly free and so hides what a text prompt costs; these
cost what a real checkpoint's does (Qwen2's pre-tokenizer pattern, a vocabulary of the model's size):
``bpe`` of 131072 tokens for the Qwen3 shapes, ``bpe248k`` of 248320 (Qwen3.5's vocabulary) for the Qwen3.5
shapes. Their ids::

    0..255        byte b -> id b (GPT-2's printable stand-in characters), as the byte tokenizer
    256..259      <|bos|> <|eos|> <|im_start|> <|im_end|>, as the byte tokenizer
    260..V-1      merged tokens, in merge order

The trained files ship in the package (``data/preset_bpe.json.xz``, about 0.7 MB, ~12 s to train on two
cores; ``data/preset_bpe_248k.json.xz``, about 1.5 MB, ~60 s): every make-model run writes the same bytes
whatever ``tokenizers`` version is installed. ``train_bpe`` rebuilds them from the recipes below
(tests/engine/test_bpe.py compares, marked slow).
"""

from __future__ import annotations

import functools
import json
import lzma
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvshare.engine.token_cache import TokenCacheConfig
from kvshare.engine.tokenizer import (
    BYTE_VOCAB_SIZE,
    EOS_ID,
    IM_END_ID,
    SPECIAL_TOKENS,
    Tokenizer,
    build_byte_tokenizer,
    byte_tokenizer_config,
    bytes_to_unicode,
)

# Qwen2's (and Qwen3's) pre-tokenizer split: letters with one leading non-letter, single digits, punctuation runs
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRESET_SEED = 20261205
DATA_DIR = os.path.join(os.path.dirname(__file__), "data")


@dataclass(frozen=True)
class PresetBPE:
    """A shipped BPE's recipe: its vocabulary, the distinct generated words it is trained on, its file."""

    vocab_size: int
    num_words: int  # enough distinct words that the corpus has pairs for vocab_size tokens
    file_name: str

    @property
    def path(self) -> str:
        return os.path.join(DATA_DIR, self.file_name)


PRESET_BPES = {
    "bpe": PresetBPE(131072, 150_000, "preset_bpe.json.xz"),
    "bpe248k": PresetBPE(248320, 300_000, "preset_bpe_248k.json.xz"),
}
PRESET_VOCAB_SIZE = PRESET_BPES["bpe"].vocab_size
PRESET_NUM_WORDS = PRESET_BPES["bpe"].num_words
DATA_FILE = PRESET_BPES["bpe"].path

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def generated_words(num_words: int, seed: int) -> list[str]:
    """``num_words`` distinct pronounceable words of 1-4 syllables, in a seeded order."""
    rng = random.Random(seed)
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    syllables += [s + end for s in syllables for end in "nrst"]
    words: set[str] = set()
    while len(words) < num_words:
        words.add("".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))))
    ordered = sorted(words)
    rng.shuffle(ordered)
    return ordered


def generated_corpus(num_words: int, seed: int) -> Iterator[str]:
    """Lines of generated prose and code: every word lower-case and capitalised, with punctuation, digits,
    indentation and blank lines (so runs of spaces and newlines get tokens of their own, as in real vocabularies)."""
    words = generated_words(num_words, seed)
    rng = random.Random(seed + 1)
    for start in range(0, len(words), 64):
        chunk = words[start : start + 64]
        yield " ".join(chunk) + ". " + str(rng.randrange(10_000)) + ",\n"
        yield " ".join(w.capitalize() for w in chunk) + "; (" + rng.choice(chunk) + ")\n\n"
        yield "    " + chunk[0] + " = " + chunk[1] + "(" + chunk[2] + ")\n\t\t" + chunk[3] + "  # " + chunk[4] + "\n"


def _base_tokenizer(vocab: dict[str, int] | None = None, merges: list[tuple[str, str]] | None = None):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE() if vocab is None else models.BPE(vocab=vocab, merges=merges or []))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(vocab_size: int = PRESET_VOCAB_SIZE, num_words: int = PRESET_NUM_WORDS, seed: int = PRESET_SEED):
    """Train the BPE on the generated corpus and lay its ids out as the module docstring shows (deterministic)."""
    from tokenizers import AddedToken, pre_tokenizers, trainers

    if vocab_size <= BYTE_VOCAB_SIZE:
        raise ValueError(f"a BPE vocabulary must be larger than the {BYTE_VOCAB_SIZE} bytes and special tokens")
    trained = _base_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    trained.train_from_iterator(generated_corpus(num_words, seed), trainer)
    merges = [tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab.update({t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)})
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tok = _base_tokenizer(vocab, merges)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def train_preset_bpe(kind: str = "bpe"):
    """Train the shipped BPE ``kind`` from its recipe."""
    recipe = PRESET_BPES[kind]
    return train_bpe(recipe.vocab_size, recipe.num_words, PRESET_SEED)


def preset_bpe_json(kind: str = "bpe") -> str:
    """The shipped tokenizer.json text of the preset BPE ``kind``."""
    with lzma.open(PRESET_BPES[kind].path, "rt", encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=len(PRESET_BPES))
def preset_bpe_text(kind: str = "bpe") -> str:
    """preset_bpe_json(kind), read once per process."""
    return preset_bpe_json(kind)


def preset_bpe_tokenizer(kind: str = "bpe"):
    """A ``tokenizers.Tokenizer`` of the preset BPE ``kind`` (each call a fresh object)."""
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_str(preset_bpe_text(kind))


PRESET_TOKENIZERS = ("byte", *PRESET_BPES)


def preset_tokenizer_files(kind: str, max_length: int):
    """(``tokenizers.Tokenizer``, tokenizer_config.json) of a preset's tokenizer: ``byte`` or a BPE of PRESET_BPES
    (all carry the same special tokens, ids and chat template)."""
    if kind == "byte":
        return build_byte_tokenizer(), byte_tokenizer_config(max_length)
    if kind in PRESET_BPES:
        return preset_bpe_tokenizer(kind), byte_tokenizer_config(max_length)
    raise ValueError(f"unknown preset tokenizer {kind!r}; choose one of {', '.join(PRESET_TOKENIZERS)}")


def preset_tokenizer(kind: str, max_length: int, cache_config: TokenCacheConfig = TokenCacheConfig()) -> Tokenizer:
    """The engine's Tokenizer of a preset's tokenizer (long texts cut and cached by ``cache_config``)."""
    tokenizer, config = preset_tokenizer_files(kind, max_length)
    text = preset_bpe_text(kind) if kind in PRESET_BPES else None
    return Tokenizer(tokenizer, config, [EOS_ID, IM_END_ID], cache_config, tokenizer_json=text)


def write_preset_bpe_data(kind: str = "bpe") -> None:
    """Train and write the shipped file of ``kind`` (``python -m kvshare.engine.bpe [KIND]``)."""
    text = train_preset_bpe(kind).to_str()
    os.makedirs(DATA_DIR, exist_ok=True)
    with lzma.open(PRESET_BPES[kind].path, "wt", encoding="utf-8", preset=9) as f:
        f.write(text)


if __name__ == "__main__":
    import sys

    write_preset_bpe_data(*sys.argv[1:2])
