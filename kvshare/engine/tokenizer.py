"""Tokenizers: the presets' byte-level one (their BPE: kvshare.engine.bpe), and a reader for any HF ``tokenizer.json``.

The byte-level tokenizer maps byte b to token id b (every ASCII character is one token,
so a prompt of exactly N tokens is N ASCII characters) plus four special tokens. It is
built offline with the ``tokenizers`` library as a BPE without merges over GPT-2's
byte alphabet, which transformers and vLLM both load as an ordinary fast tokenizer.
Chat templates are rendered with plain jinja2, in the sandbox transformers uses.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence

import numpy as np

from kvshare.engine.token_cache import PieceEncoder, PieceLookup, TokenCache, TokenCacheConfig
from kvshare.engine.token_share import SharedPieces
from kvshare.errors import UserError

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 256, 257, 258, 259
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces, e.g. <0xE5>

# ChatML; renders the same under transformers and plain jinja2 (no extensions, no custom filters)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what the ByteLevel pre-tokenizer emits)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_UNICODE_TO_BYTE = {ch: b for b, ch in bytes_to_unicode().items()}


def build_byte_tokenizer():
    """A ``tokenizers.Tokenizer``: id b for byte b, then the special tokens at 256.."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size() != BYTE_VOCAB_SIZE or tok.token_to_id("<|im_end|>") != IM_END_ID:
        raise RuntimeError("byte tokenizer ids are not laid out as expected")
    return tok


def byte_tokenizer_config(max_length: int) -> dict:
    """tokenizer_config.json of both preset tokenizers (the same special tokens and ids, no automatic BOS)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|eos|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def render_chat(template: str, messages: Sequence[dict], add_generation_prompt: bool = True, **extra) -> str:
    """Render a chat template with jinja2's immutable sandbox, as transformers does."""
    return _compiled_chat_template(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **extra
    )


@functools.lru_cache(maxsize=16)
def _compiled_chat_template(template: str):
    """The template compiled once (compiling a model's chat template took 13-28 ms, rendering it a fraction of
    that); a jinja2 Template holds no state between renders, so one serves every thread."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


class Tokenizer:
    """encode/decode/chat template over a tokenizer.json and its tokenizer_config.json."""

    def __init__(
        self,
        tokenizer,
        config: dict,
        eos_token_ids: Sequence[int] = (),
        cache_config: TokenCacheConfig = TokenCacheConfig(),
        tokenizer_json: str | None = None,
    ) -> None:
        """``tokenizer_json``: the tokenizer.json text ``tokenizer`` was read from (saves writing it out again)."""
        self._tok = tokenizer
        # long texts: cut, cached and batched where that gives the same ids (kvshare.engine.token_cache)
        self._pieces = PieceEncoder(tokenizer, cache_config, tokenizer_json=tokenizer_json)
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id: int | None = eos
        # every id that ends generation unless ignore_eos (the tokenizer's eos and generation_config's)
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys([*(i for i in [eos] if i is not None), *eos_token_ids])
        )
        self.vocab_size = tokenizer.get_vocab_size()
        self._special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_dir(cls, model_dir: str, cache_config: TokenCacheConfig = TokenCacheConfig()) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise UserError(f"{model_dir} has no tokenizer.json (the built-in engine needs a fast tokenizer file)")
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        generation = _read_json(os.path.join(model_dir, "generation_config.json"))
        eos = generation.get("eos_token_id", [])
        with open(path, encoding="utf-8") as f:
            text = f.read()
        eos_ids = eos if isinstance(eos, list) else [eos]
        return cls(HFTokenizer.from_str(text), config, eos_ids, cache_config, tokenizer_json=text)

    @classmethod
    def byte_level(cls, max_length: int) -> Tokenizer:
        return cls(build_byte_tokenizer(), byte_tokenizer_config(max_length), [EOS_ID, IM_END_ID])

    def encode(self, text: str) -> list[int]:
        """The text's ids, no special tokens added; equal to one plain encode of the whole text."""
        return self._pieces.encode(text)

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as one int64 array (a replica's prompt), without a list of ids between."""
        return self._pieces.encode_array(text)

    def look_up(self, text: str) -> PieceLookup:
        """``encode_array`` in two steps: the text's pieces looked up in the cache levels (nothing encoded), then
        ``encode_missing`` of the lookup (kvshare.engine.token_cache)."""
        return self._pieces.look_up(text)

    def encode_missing(self, lookup: PieceLookup) -> np.ndarray:
        return self._pieces.encode_missing(lookup)

    @property
    def token_cache(self) -> TokenCache:
        return self._pieces.cache

    def share_pieces(self, shared: SharedPieces | None) -> None:
        """Look pieces up in (and write them to) ``shared`` too: the level other replicas on this host fill."""
        self._pieces.shared = shared

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # ids the tokenizer does not know (a model vocabulary larger than the tokenizer's) decode to nothing
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: maybe part of a UTF-8 character (byte-level BPE, byte fallback).

        decode([id]) cannot say: a lone continuation byte decodes to U+FFFD like any other. The
        vocabulary's piece can: GPT-2's byte alphabet or a ``<0xNN>`` piece, taken only where it
        decodes to what the tokenizer's own decoder gives. Special tokens give their text.
        """
        text = self.decode([token_id], skip_special_tokens=False)
        piece = self._tok.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if piece is None or "\ufffd" not in text:
            return text.encode()
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            raw = bytes([int(fallback.group(1), 16)])
        elif all(ch in _UNICODE_TO_BYTE for ch in piece):
            raw = bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        else:
            return text.encode()
        return raw if raw.decode("utf-8", errors="replace") == text else text.encode()

    def is_special(self, token_id: int) -> bool:
        """A special token (EOS, chat markers): its text is left out of an answer's text."""
        return token_id in self._special_ids

    def warm_up(self) -> None:
        """Pay a fresh tokenizer's one-time cost of its first chat before any request: the chat template's compile
        (~25 ms of a fresh replica's first text request on 2 cores, benchmarks/tokenize_cost.py --fresh).
        Nothing is cached; a template that cannot render a one-message chat is left to the requests to report."""
        from jinja2.exceptions import TemplateError

        if not self.chat_template:
            return
        try:
            self.chat_text([{"role": "user", "content": "warm-up"}])
        except TemplateError:
            pass

    def chat_text(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template rendered over ``messages`` (the text whose ids a chat request's prompt is)."""
        if not self.chat_template:
            raise UserError("this model's tokenizer has no chat template (use a completion request)")
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.chat_text(messages, add_generation_prompt))


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|eos|>", ...} in older tokenizer configs
        return value.get("content")
    return value


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)
