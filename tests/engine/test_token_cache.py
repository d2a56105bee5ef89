"""The piece encoder: ids of cut, cached, batched texts equal one plain encode; the cache is bounded and keyed."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.engine.bpe import preset_bpe_tokenizer
from kvshare.engine.token_cache import (
    ENTRY_OVERHEAD,
    GPT2_PATTERN,
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    PieceEncoder,
    TokenCache,
    TokenCacheConfig,
    safe_cuts,
)
from kvshare.engine.tokenizer import SPECIAL_TOKENS, Tokenizer, byte_tokenizer_config, render_chat

EVERY_CUT = TokenCacheConfig(piece_chars=1, min_chars=0)  # a cut at every safe point: the most edges


def _small_bpe(pattern: str | None, nfc: bool = False, vocab_size: int = 600):
    """A BPE trained in a blink on mixed text: ``pattern`` None: ByteLevel's own (GPT-2) regex."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "The cafe's naive resumes don't stop: 12345 words, and tabs\tand  spaces.\n" * 3,
        "東京 is 大きい. Ünïcödé áccents é (quoted) 'it' we'll 3.14 $5 -- ok!?\n" * 3,
        "    indented  code\n\n\t\tx   =  y  \n  \n" * 3,
    ] * 20  # merged whitespace runs, as real vocabularies
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


@functools.cache
def _tokenizers() -> dict[str, tuple[object, str]]:
    """name -> (tokenizer, its tokenizer.json text): built once, each encoder then skips writing it out."""
    toks = {
        "preset-bpe": preset_bpe_tokenizer(),
        "gpt2": _small_bpe(None),
        "qwen2-nfc": _small_bpe(QWEN2_PATTERN, nfc=True),
        "llama3": _small_bpe(LLAMA3_PATTERN),
    }
    return {name: (tok, tok.to_str()) for name, tok in toks.items()}


def _encoder(name: str, config: TokenCacheConfig, cache: TokenCache | None = None) -> PieceEncoder:
    tok, text = _tokenizers()[name]
    return PieceEncoder(tok, config, cache, tokenizer_json=text)


FRAGMENTS = [
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    " \n",
    "\r\n",
    "a",
    "the",
    " word",
    "Word",
    "'s",
    "'ll",
    "don't",
    "123",
    "4",
    ".",
    ",",
    "!?",
    "(",
    ")",
    "--",
    "é",
    "e\u0301",
    "\u0301",
    "東京",
    "大きい",
    "Ü",
    "\u00a0",
    "\u3000",
    "\u2028",
    "\u001c",
    "\u0085",
    "<|im_start|>",
    "<|im_end|>",
    "<|im",
    "|>",
    "🙂",
    "\u200b",
    "ǅ",
    "Ⅻ",
]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=60).map("".join)


@pytest.mark.parametrize("name", ["preset-bpe", "gpt2", "qwen2-nfc", "llama3"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, piece_chars=st.integers(1, 24))
def test_pieces_encode_to_the_plain_ids(name, text, piece_chars):
    """Cut at safe points (every piece edge a chunk edge), the ids equal one plain encode: fails when the
    left-hand check of safe_cuts is removed (a cut between two spaces: '\\t' + ' x' then pre-tokenize apart)."""
    tok = _tokenizers()[name][0]
    encoder = _encoder(name, TokenCacheConfig(piece_chars=piece_chars, min_chars=0))
    assert encoder.is_splittable, encoder.not_splittable
    plain = tok.encode(text, add_special_tokens=False).ids
    assert encoder.encode(text) == plain
    assert encoder.encode(text) == plain  # the second time from the cache
    array = encoder.encode_array(text)  # a replica's prompt: the cached pieces joined into one int64 array
    assert array.dtype == np.int64 and array.tolist() == plain


@settings(max_examples=200, deadline=None)
@given(text=texts, more=texts, piece_chars=st.integers(1, 24))
def test_cuts_of_a_text_are_the_cuts_of_its_extension(text, more, piece_chars):
    """A longer text (the next turn) is cut where its prefix was: every piece but the prefix's last hits."""
    cuts = safe_cuts(text, piece_chars)
    assert cuts == [c for c in safe_cuts(text + more, piece_chars) if c < len(text)]
    assert all(text[c] == " " and not text[c - 1].isspace() for c in cuts)


def test_the_next_turn_encodes_only_its_last_pieces():
    """Fails when the piece encoder skips its cache lookup (every piece is then encoded again)."""
    bpe, text = _tokenizers()["preset-bpe"]
    tok = Tokenizer(
        bpe,
        byte_tokenizer_config(4096),
        cache_config=TokenCacheConfig(piece_chars=64, min_chars=0),
        tokenizer_json=text,
    )
    first = "<|im_start|>user\n" + " ".join(f"bako{i} zu" for i in range(400)) + "<|im_end|>\n"
    second = first + "<|im_start|>assistant\nsure thing<|im_end|>\n<|im_start|>user\nand more words<|im_end|>\n"
    assert tok.encode(first) == tok._pieces.plain(first)
    cache = tok.token_cache
    misses_before = cache.num_misses
    assert tok.encode(second) == tok._pieces.plain(second)
    assert cache.num_misses - misses_before <= 2  # the first text's last piece and the new tail
    assert cache.num_hits >= len(safe_cuts(first, 64)) - 1


def test_the_cache_is_bounded_in_bytes_least_recent_first_out():
    tok = _tokenizers()["preset-bpe"][0]
    encoder = _encoder("preset-bpe", TokenCacheConfig(max_bytes=2000, piece_chars=16, min_chars=0))
    texts = [" ".join(f"w{i}x{j}" for j in range(60)) for i in range(5)]
    for text in texts:
        assert encoder.encode(text) == tok.encode(text, add_special_tokens=False).ids
        assert encoder.cache.num_bytes <= 2000
    assert 0 < len(encoder.cache) < len(safe_cuts(texts[0], 16)) * len(texts)
    assert encoder.encode(texts[-1]) == tok.encode(texts[-1], add_special_tokens=False).ids
    hits = encoder.cache.num_hits
    encoder.encode(texts[-1])
    assert encoder.cache.num_hits > hits  # the latest text's pieces stayed


def test_cached_pieces_are_read_only_uint32_arrays_counted_at_their_size():
    """The bound counts what the cache holds: each piece a read-only uint32 array of 4 bytes a token (fails when
    pieces are kept as lists of ints, ~9x the bytes counted); an array handed out is the caller's own."""
    encoder = _encoder("preset-bpe", TokenCacheConfig(piece_chars=16, min_chars=0))
    text = " ".join(f"w{i}x naïve 東京" for i in range(80))
    ids = encoder.encode_array(text)
    entries = list(encoder.cache._entries.values())
    assert all(isinstance(e, np.ndarray) and e.dtype == np.uint32 and not e.flags.writeable for e in entries)
    assert encoder.cache.num_bytes == sum(e.nbytes + ENTRY_OVERHEAD for e in entries)
    assert len(entries) == len(safe_cuts(text, 16)) + 1  # the text's pieces only (the probe's are not kept)
    ids[:] = 0
    assert encoder.encode_array(text).tolist() == encoder.plain(text)


def test_a_cache_shared_by_two_tokenizers_keeps_their_ids_apart():
    """Fails when the tokenizer identity is left out of the key: the second tokenizer would get the first's ids."""
    shared = TokenCache(1 << 20)
    config = TokenCacheConfig(piece_chars=8, min_chars=0)
    bpe, small = _tokenizers()["preset-bpe"][0], _tokenizers()["gpt2"][0]
    text = " ".join(["the cafe's naive words"] * 20)
    a, b = _encoder("preset-bpe", config, shared), _encoder("gpt2", config, shared)
    assert a.identity != b.identity
    assert a.encode(text) == bpe.encode(text, add_special_tokens=False).ids
    assert b.encode(text) == small.encode(text, add_special_tokens=False).ids != a.encode(text)


@pytest.mark.parametrize("change", ["prefix_space", "metaspace", "unknown_pattern", "lowercase", "stripping_token"])
def test_tokenizers_it_cannot_prove_safe_are_encoded_whole(change):
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers

    tok = _small_bpe(QWEN2_PATTERN)
    if change == "prefix_space":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif change == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
    elif change == "unknown_pattern":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\S+\s?"), behavior="isolated"), pre_tokenizers.ByteLevel(use_regex=False)]
        )
    elif change == "lowercase":
        tok.normalizer = normalizers.Lowercase()
    else:
        tok.add_special_tokens([AddedToken("<sep>", special=True, lstrip=True)])
    encoder = PieceEncoder(tok, EVERY_CUT)
    assert not encoder.is_splittable
    text = "Two words <sep> and  more words" * 4
    assert encoder.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert len(encoder.cache) == 0


def test_a_tokenizer_json_of_another_shape_is_not_splittable():
    from kvshare.engine.token_cache import read_head, splittable_reason

    assert splittable_reason(read_head('{"model": {"type": "BPE", "dropout": "high"}}')) is not None
    assert splittable_reason(read_head("[]")) is not None
    assert splittable_reason(read_head('{"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel"}}')) is None


def test_the_presets_tokenizers():
    assert _encoder("preset-bpe", TokenCacheConfig()).is_splittable
    assert GPT2_PATTERN != QWEN2_PATTERN != LLAMA3_PATTERN
    byte = Tokenizer.byte_level(64)  # one word for the whole text: nothing to cut, encoded whole
    assert not byte._pieces.is_splittable and byte.encode("ab c") == [97, 98, 32, 99]


def test_the_chat_path_reuses_the_previous_turns_pieces():
    """serve's chat path (chat_prompt_ids: template, then encode): the next turn's ids equal a plain encode of
    its rendered text, and every piece of the previous turn but its last comes from the cache (fails when the
    piece encoder skips its cache lookup)."""
    from kvshare.serve import api_types as A
    from kvshare.serve.tokenize import chat_prompt_ids

    bpe, text = _tokenizers()["preset-bpe"]
    tok = Tokenizer(
        bpe,
        byte_tokenizer_config(1 << 20),
        cache_config=TokenCacheConfig(piece_chars=256, min_chars=0),
        tokenizer_json=text,
    )
    words = " ".join(tok.decode([i]).strip() for i in range(100_000, 103_000))
    turn = [A.ChatMessage(role="system", content="Be brief."), A.ChatMessage(role="user", content=words)]
    first = chat_prompt_ids(tok, turn).tolist()
    turn += [A.ChatMessage(role="assistant", content="Sure."), A.ChatMessage(role="user", content="And then?")]
    misses = tok.token_cache.num_misses
    second = chat_prompt_ids(tok, turn)
    assert second.dtype == np.int64  # what the engine takes
    second = second.tolist()
    rendered = render_chat(
        tok.chat_template, [{"role": m.role, "content": m.content} for m in turn], True, bos_token="", eos_token=""
    )
    assert second == tok._pieces.plain(rendered) and second[: len(first) - 3] == first[: len(first) - 3]
    assert tok.token_cache.num_misses - misses <= 2 and tok.token_cache.num_hits >= 10


def test_the_tokenizers_warm_up_caches_nothing_and_leaves_template_errors_to_requests():
    """warm_up compiles the chat template without caching ids; a template that refuses the warm-up's chat (or
    none at all) is no start-up error (fails when warm_up lets the template's TemplateError out)."""
    from jinja2.exceptions import TemplateError

    bpe, text = _tokenizers()["preset-bpe"]
    tok = Tokenizer(bpe, byte_tokenizer_config(4096), tokenizer_json=text)
    tok.warm_up()
    assert len(tok.token_cache) == 0 and tok._pieces.num_encoded == 0
    strict = byte_tokenizer_config(4096) | {"chat_template": "{{ raise_exception('only system messages') }}"}
    refusing = Tokenizer(bpe, strict, tokenizer_json=text)
    refusing.warm_up()
    with pytest.raises(TemplateError, match="only system"):
        refusing.apply_chat_template([{"role": "user", "content": "hi"}])
    Tokenizer(bpe, {}, tokenizer_json=text).warm_up()  # no chat template: nothing to warm
