"""Logprobs in the two OpenAI shapes (completions and chat) from engine token events."""

from __future__ import annotations

from typing import Any


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer: Any, events: list[Any]) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for event in events:
        text = _token_text(tokenizer, event.token_id)
        tokens.append(text)
        token_logprobs.append(event.logprob)
        top.append({_token_text(tokenizer, t): lp for t, lp in (event.top_logprobs or {}).items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, events: list[Any]) -> dict:
    content = []
    for event in events:
        text = _token_text(tokenizer, event.token_id)
        content.append({
            "token": text,
            "logprob": event.logprob,
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": _token_text(tokenizer, t), "logprob": lp, "bytes": list(_token_text(tokenizer, t).encode())}
                for t, lp in (event.top_logprobs or {}).items()
            ],
        })
    return {"content": content}
