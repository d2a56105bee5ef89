"""Logprobs in the two OpenAI shapes (completions and chat) from engine token events.

A token is named by its text. One that is not whole UTF-8 on its own (a byte of a multi-byte
character, from byte-level BPE or byte fallback) decodes to U+FFFD like every other such
byte, so two of them would collide as keys of a completion's ``top_logprobs``: it is named
as OpenAI names it, ``bytes:`` and its bytes escaped (``bytes:\\xe4\\xbd``), and chat's
``bytes`` carry the token's raw bytes. Special tokens are named by their text (as vLLM does);
an id the tokenizer does not know (a synthetic preset's vocabulary is larger than its byte
tokenizer's) has no text at all and is named ``token_id:N`` (vLLM's placeholder), ``bytes`` null.
"""

from __future__ import annotations

import codecs
from typing import Any


def token_name(tokenizer: Any, token_id: int) -> tuple[str, bytes | None]:
    """A token's name in logprobs and its raw bytes (None: an id outside the tokenizer's vocabulary)."""
    if not 0 <= token_id < tokenizer.vocab_size:
        return f"token_id:{token_id}", None
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


class TextOffsets:
    """``text_offset``: characters of the answer's text before each token; bytes of a split character count
    once and special tokens not at all. One per answer, so the offsets of a stream's chunks run on."""

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0

    def advance(self, tokenizer: Any, token_id: int, raw: bytes | None) -> int:
        """The offset of this token; the next one's is past its text."""
        at = self.offset
        if raw is not None and not tokenizer.is_special(token_id):  # special tokens are not in the text
            self.offset += len(self._text.decode(raw))
        return at


def completion_logprobs(tokenizer: Any, events: list[Any], offsets: TextOffsets | None = None) -> dict:
    """``offsets``: where the answer's text stands before ``events`` (a stream passes one per answer)."""
    offsets = offsets or TextOffsets()
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for event in events:
        name, raw = token_name(tokenizer, event.token_id)
        tokens.append(name)
        token_logprobs.append(event.logprob)
        top.append({token_name(tokenizer, t)[0]: lp for t, lp in (event.top_logprobs or {}).items()})
        text_offset.append(offsets.advance(tokenizer, event.token_id, raw))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


def chat_logprobs(tokenizer: Any, events: list[Any]) -> dict:
    content = []
    for event in events:
        name, raw = token_name(tokenizer, event.token_id)
        top = []
        for t, lp in (event.top_logprobs or {}).items():
            top_name, top_raw = token_name(tokenizer, t)
            top.append({"token": top_name, "logprob": lp, "bytes": _listed(top_raw)})
        content.append({"token": name, "logprob": event.logprob, "bytes": _listed(raw), "top_logprobs": top})
    return {"content": content}


def _listed(raw: bytes | None) -> list[int] | None:
    return None if raw is None else list(raw)
