"""Token ids of a long text: cut at safe points, the pieces encoded in parallel and cached by their content.

A text of 128k tokens takes a single-threaded BPE encode about as long as a cross-replica hit's whole load;
a conversation's next turn (or the same document sent again) repeats all but its end. So a long text is
cut into pieces of about ``piece_chars`` characters, each piece's ids are looked up by (tokenizer identity,
the piece's content hash), and the missing pieces are encoded in one ``encode_batch`` call (the Rust side
runs them on its thread pool, without the GIL)::

    text:    |<- piece 0 ->|<- piece 1 ->|<- piece 2 ...->|     cuts at safe points, found left to right,
    ids:     [ cached     ][ cached     ][ encoded       ]     so a longer text shares every cut but the last

Each piece's ids are kept as one read-only uint32 array (its 4 bytes a token are what the cache's bound counts),
and a replica's prompt is their concatenation into one int64 array (``encode_array``): lists of Python ints
between had cost ~8 ms of a 128k-token cross-replica hit on 2 cores (benchmarks/tokenize_cost.py --fresh).

Safe point p: ``text[p] == " "`` and ``text[p - 1]`` a letter, a digit or ASCII punctuation. For the
tokenizers ``is_splittable`` accepts (a BPE over a known regex pre-tokenizer, no normalizer but NFC, added
tokens without whitespace or stripping), encode(text) == encode(text[:p]) + encode(text[p:]):

- every pattern's non-whitespace alternatives stop at a space, so a pre-token ends at p in the whole text;
- before p, only ``\\s+(?!\\S)`` looks ahead, and its run cannot end at p (text[p - 1] is no whitespace);
- no alternative looks behind, so matching from p sees the same as matching the piece from its start;
- the BPE runs within one pre-token; an added token cannot straddle p (it holds no space); a space is an
  NFC boundary (it composes with nothing before it).

Any other tokenizer, or one that fails the probe at construction, is encoded whole (fail closed).
``look_up`` (cut, hash, both levels) and ``encode_missing`` (the encode of what neither level held) are two steps,
so that a server runs only the second off its event loop, and only when what is left to encode is long.
A second level (kvshare.engine.token_share) shares pieces between the processes of one user on one host:
a piece this process misses is looked up there before it is encoded, and what it encodes is written there.
tests/engine/test_token_cache.py checks the equality on random unicode texts with hypothesis.
"""

from __future__ import annotations

import string
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import xxhash

if TYPE_CHECKING:
    from kvshare.engine.token_share import SharedPieces

# the GPT-2 pattern (ByteLevel's own regex), Qwen2/Qwen3's, Llama 3's
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PATTERN = QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
SPLITTABLE_PATTERNS = frozenset({GPT2_PATTERN, QWEN2_PATTERN, LLAMA3_PATTERN})
_SAFE_LEFT = frozenset(string.punctuation)
# a probe of what the fast path meets (special tokens, unicode, numbers, punctuation, runs of spaces)
_PROBE = (
    "<|im_start|>user\nThe café's 12345 naïve  résumés, (don't) stop: 東京 is 大きい. Ünïcödé "
    "words\tand tabs;  double  spaces. x! 3.14 and $5 'quoted' <|im_end|> end"
) * 24


@dataclass(frozen=True)
class TokenCacheConfig:
    max_bytes: int = 64 << 20  # ids held, at 4 bytes a token plus ENTRY_OVERHEAD a piece
    piece_chars: int = 8192  # a piece ends at the first safe point at or after this many characters
    min_chars: int = 16384  # shorter texts: one plain encode (nothing to gain)

    def __post_init__(self) -> None:
        if self.max_bytes < 0 or self.piece_chars < 1 or self.min_chars < 0:
            raise ValueError("max_bytes, piece_chars and min_chars must be positive")


ENTRY_OVERHEAD = 128  # bytes counted per cached piece beside its ids (key, list node)


class _ModelHead(msgspec.Struct, frozen=True):
    type: str | None = None
    dropout: float | None = None


class _TokenizerHead(msgspec.Struct):
    """The parts of a tokenizer.json that decide splitting (the vocabulary and merges are skipped, not built)."""

    model: _ModelHead = _ModelHead()
    normalizer: Any = None
    pre_tokenizer: Any = None
    added_tokens: Any = None
    truncation: Any = None
    padding: Any = None


def read_head(tokenizer_json: str | bytes) -> dict:
    """The splitting-relevant fields of a tokenizer.json, as plain values (fast: a 131k vocabulary is skipped);
    a file of another shape gives {} (not splittable)."""
    try:
        return msgspec.to_builtins(msgspec.json.decode(tokenizer_json, type=_TokenizerHead))
    except (msgspec.ValidationError, msgspec.DecodeError):
        return {}


def splittable_reason(tokenizer_json: dict) -> str | None:
    """None when texts of this tokenizer may be cut at safe points (module docstring); else why not."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0.0):
        return "the model is not a BPE without dropout"
    if tokenizer_json.get("normalizer") not in (None, {"type": "NFC"}):
        return "the normalizer is not none or NFC"
    if tokenizer_json.get("truncation") is not None or tokenizer_json.get("padding") is not None:
        return "truncation or padding is set"
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return "the ByteLevel pre-tokenizer adds a prefix space or splits nothing"
    elif pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        split, byte_level = pre["pretokenizers"]
        if (
            split.get("type") != "Split"
            or (split.get("pattern") or {}).get("Regex") not in SPLITTABLE_PATTERNS
            or split.get("behavior") != "Isolated"
            or split.get("invert")
        ):
            return "the split pattern is not one of the known ones"
        if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space") or byte_level.get("use_regex"):
            return "the split is not followed by a plain ByteLevel"
    else:
        return "the pre-tokenizer is not a known byte-level split"
    for added in tokenizer_json.get("added_tokens") or []:
        content = added.get("content", "")
        is_stripping = added.get("lstrip") or added.get("rstrip") or added.get("single_word")
        if any(ch.isspace() for ch in content) or is_stripping:
            return f"added token {content!r} holds whitespace or strips it"
    return None


def safe_cuts(text: str, piece_chars: int) -> list[int]:
    """Where ``text`` is cut: the first safe point at or after each previous cut + ``piece_chars``."""
    cuts: list[int] = []
    start, end = 0, len(text)
    while True:
        p = max(start + piece_chars, 1)
        while p < end:
            p = text.find(" ", p)
            if p < 0:
                return cuts
            if text[p - 1] in _SAFE_LEFT or text[p - 1].isalnum():
                break
            p += 1
        if p >= end:
            return cuts
        cuts.append(p)
        start = p


class TokenCache:
    """Piece ids (read-only uint32 arrays) by (tokenizer identity, content hash), least recently used first out,
    bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self._entries: OrderedDict[tuple[str, bytes], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # look-ups run on the event loop, long encodes and /tokenize on threads

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, bytes]) -> np.ndarray | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self.num_misses += 1
                return None
            self._entries.move_to_end(key)
            self.num_hits += 1
            return ids

    def put(self, key: tuple[str, bytes], ids: np.ndarray) -> None:
        size = entry_bytes(ids)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = ids
            self.num_bytes += size
            while self.num_bytes > self.max_bytes:
                _key, old = self._entries.popitem(last=False)
                self.num_bytes -= entry_bytes(old)


def entry_bytes(ids: Sequence[int]) -> int:
    return 4 * len(ids) + ENTRY_OVERHEAD


class PieceEncoder:
    """encode(text) of one ``tokenizers.Tokenizer``: cut, cached and batched where that is safe, else whole."""

    def __init__(
        self,
        tokenizer: Any,
        config: TokenCacheConfig = TokenCacheConfig(),
        cache: TokenCache | None = None,
        tokenizer_json: str | None = None,
        shared: SharedPieces | None = None,
    ) -> None:
        """``tokenizer_json``: the text ``tokenizer`` was read from (default: ``tokenizer.to_str()``); ``shared``:
        the second level, pieces other processes of this user encoded (kvshare.engine.token_share)."""
        self._tok = tokenizer
        self.config = config
        text = (tokenizer_json if tokenizer_json is not None else tokenizer.to_str()).encode()
        self.identity = xxhash.xxh3_128_hexdigest(text)  # the cache's keys: ids of another tokenizer never match
        self.cache = cache if cache is not None else TokenCache(config.max_bytes)
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.not_splittable = splittable_reason(read_head(text))
        self.shared: SharedPieces | None = None  # set after the probe: its pieces are not written out
        self.num_encoded = 0
        if self.not_splittable is None and self._pieces_ids(_PROBE, 37, is_cached=False).tolist() != self.plain(_PROBE):
            self.not_splittable = "the probe's pieces do not encode to the whole text's ids"
        self.shared = shared
        self.num_encoded = 0  # pieces encoded since (found in neither level)

    @property
    def is_splittable(self) -> bool:
        return self.not_splittable is None

    def plain(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        if self.not_splittable is not None or len(text) < self.config.min_chars:
            return self.plain(text)
        return self._pieces_ids(text, self.config.piece_chars).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as one int64 array, built from the pieces' arrays without a list between."""
        return self.encode_missing(self.look_up(text))

    def look_up(self, text: str) -> PieceLookup:
        """The text cut and its pieces looked up in both levels, nothing encoded: a hash and a lookup a piece (and
        a file read a piece the shared level holds). ``encode_missing`` does the rest: the one step whose cost
        grows with what no process has encoded, which a server runs off its event loop when it is long."""
        if self.not_splittable is not None or len(text) < self.config.min_chars:
            return PieceLookup([text], [None], None, [])  # one plain encode, nothing cached
        return self._look_up(text, self.config.piece_chars)

    def encode_missing(self, lookup: PieceLookup) -> np.ndarray:
        """The ids (int64) of a looked-up text: its missing pieces encoded (in one ``encode_batch``) and cached."""
        if lookup.keys is None:
            return np.array(self.plain(lookup.pieces[0]), dtype=np.int64)
        found, missing = lookup.found, [i for i, ids in enumerate(lookup.found) if ids is None]
        if missing:
            encoded = self._encode_batch([lookup.pieces[i] for i in missing], add_special_tokens=False)
            self.num_encoded += len(missing)
            for i, enc in zip(missing, encoded):
                found[i] = ids = np.array(enc.ids, dtype=np.uint32)
                ids.flags.writeable = False  # one array serves every later text holding the piece
                if lookup.is_cached:
                    self.cache.put(lookup.keys[i], ids)
            if lookup.is_cached and self.shared is not None:
                identity = bytes.fromhex(self.identity)
                entries = [(identity, lookup.keys[i][1], lookup.nbytes[i], found[i]) for i in missing]
                self.shared.put_many(entries)
        return np.concatenate(found, dtype=np.int64)

    def _pieces_ids(self, text: str, piece_chars: int, is_cached: bool = True) -> np.ndarray:
        """The text's ids (int64); ``is_cached`` False: neither level is read or written."""
        return self.encode_missing(self._look_up(text, piece_chars, is_cached))

    def _look_up(self, text: str, piece_chars: int, is_cached: bool = True) -> PieceLookup:
        bounds = [0, *safe_cuts(text, piece_chars), len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        raw = [p.encode("utf-8", "surrogatepass") for p in pieces]
        keys = [(self.identity, xxhash.xxh3_128_digest(b)) for b in raw]
        found = [self.cache.get(k) for k in keys] if is_cached else [None] * len(keys)
        missing = [i for i, ids in enumerate(found) if ids is None]
        if missing and is_cached and self.shared is not None:  # pieces another process of this user encoded
            identity = bytes.fromhex(self.identity)
            for i in missing:
                found[i] = self.shared.get(identity, keys[i][1], len(raw[i]))
                if found[i] is not None:
                    self.cache.put(keys[i], found[i])
        return PieceLookup(pieces, found, keys, [len(b) for b in raw], is_cached)


@dataclass
class PieceLookup:
    """A text's pieces and what the cache levels held of them (``PieceEncoder.look_up``)."""

    pieces: list[str]
    found: list[np.ndarray | None]  # per piece: its ids, None where it is still to be encoded
    keys: list[tuple[str, bytes]] | None  # per piece: its cache key; None: the text is encoded whole
    nbytes: list[int]  # per piece: its UTF-8 length (the shared level's entries name it)
    is_cached: bool = True  # False: what is encoded is not written to the cache levels

    @property
    def num_missing_chars(self) -> int:
        """Characters of text still to be encoded."""
        return sum(len(p) for p, ids in zip(self.pieces, self.found) if ids is None)
