"""The load tool's conversations: seeded, multi-turn, with prefixes shared between sessions.

A session runs conversations one after another; each opens with one of a few
shared documents (so sessions reuse each other's prefixes through the pool and
replicas' caches) and grows by the model's reply and a new user message per turn
until the next turn would pass ``max_context_tokens``::

    turn 0   [document d][question]
    turn 1   [document d][question][reply 0][message 1]
    ...      (a new conversation once the prompt nears max_context_tokens)

Chat sessions send messages, completion sessions one growing text prompt. Pure:
the same seed gives the same documents and messages (the replies are the model's).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

_SYLLABLES = ("ka", "lo", "mi", "ven", "tor", "sha", "rel", "dun", "pi", "gor", "nel", "za", "qui", "bra", "ost")


def words(rng: random.Random, num_chars: int) -> str:
    """Pseudo-words from ``rng`` of about ``num_chars`` characters (one token each in a byte-level vocabulary)."""
    out: list[str] = []
    length = 0
    while length < num_chars:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        out.append(word)
        length += len(word) + 1
    return " ".join(out)[:num_chars]


def documents(seed: int, count: int, min_chars: int, max_chars: int) -> list[str]:
    """The shared openings: ``count`` documents of min_chars..max_chars characters."""
    rng = random.Random(f"documents/{seed}")
    return [f"Document {i}. " + words(rng, rng.randint(min_chars, max_chars)) for i in range(count)]


@dataclass
class Conversation:
    """One conversation of one session: what the next request asks."""

    kind: str  # "chat" | "completion"
    document: str
    rng: random.Random
    messages: list[dict] = field(default_factory=list)
    prompt: str = ""
    num_turns: int = 0

    def __post_init__(self) -> None:
        question = "Question: " + words(self.rng, self.rng.randint(20, 80)) + "?"
        if self.kind == "chat":
            self.messages = [{"role": "system", "content": self.document}, {"role": "user", "content": question}]
        else:
            self.prompt = f"{self.document}\n\nQ: {question}\nA:"

    def body(self, model: str, max_tokens: int) -> dict[str, Any]:
        """The next request (streamed, greedy, with the generated token ids returned)."""
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if self.kind == "chat":
            body["messages"] = [dict(m) for m in self.messages]
        else:
            body["prompt"] = self.prompt
        return body

    def advance(self, reply: str) -> None:
        """Append the model's reply and the user's next message."""
        message = words(self.rng, self.rng.randint(30, 120))
        if self.kind == "chat":
            self.messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": message}]
        else:
            self.prompt += f"{reply}\nQ: {message}\nA:"
        self.num_turns += 1


def reference_body(body: dict[str, Any]) -> dict[str, Any]:
    """The same request computed from scratch: no pool, no local cache, not streamed, with top-2 logprobs.

    Logprobs do not change greedy sampling; they say how close a mismatch's first step was to a tie.
    """
    ref = dict(body, stream=False, kvshare={"use_pool": False, "use_local_cache": False})
    ref.pop("stream_options", None)
    if "messages" in ref:
        ref.update(logprobs=True, top_logprobs=2)
    else:
        ref["logprobs"] = 2
    return ref
