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


def completion_logprobs(tokenizer: Any, events: list[Any]) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    # text_offset: characters of the answer's text before each token; bytes of a split character count once
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offset = 0
    for event in events:
        name, raw = token_name(tokenizer, event.token_id)
        tokens.append(name)
        token_logprobs.append(event.logprob)
        top.append({token_name(tokenizer, t)[0]: lp for t, lp in (event.top_logprobs or {}).items()})
        offsets.append(offset)
        if raw is not None and not tokenizer.is_special(event.token_id):  # special tokens are not in the text
            offset += len(text.decode(raw))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


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
