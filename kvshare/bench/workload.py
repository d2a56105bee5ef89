"""Prompts of exact lengths in tokens, each with a unique head, and multi-turn sessions.

A measured prompt looks like::

    [shared system prompt (optional)] [unique header: run nonce + unit tag] [filler words ...]
    |<-------------------------------- exactly num_tokens tokens ----------------------------->|

The unique header sits in the first chunk after the shared part, so no measured
request can hit a cache (local or pool) by accident: only the reuse an experiment
sets up on purpose happens. Completion prompts are sent as token ids (exact by
construction); chat prompts are text, rendered with the model's chat template and
measured with its tokenizer, the filler adjusted until the count is exact.
Filler is drawn from "words" that are one token each and round-trip through
decode/encode unchanged (space-led words for BPE vocabularies, letters for the
byte-level one).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

_WORD = re.compile(r"^ ?[A-Za-z]{1,12}$")
MAX_SCAN_IDS = 50_000
MAX_FIT_ATTEMPTS = 12


def filler_vocabulary(tokenizer: Any, sample_seed: int = 0) -> list[int]:
    """Token ids of one-token words whose concatenation decodes and re-encodes to the same ids."""
    words, spaced = [], []
    for token_id in range(min(tokenizer.vocab_size, MAX_SCAN_IDS)):
        text = tokenizer.decode([token_id])
        if _WORD.match(text) and tokenizer.encode(text) == [token_id]:
            (spaced if text.startswith(" ") else words).append(token_id)
    for candidates in (spaced, words):  # space-led words keep BPE from merging neighbours
        if len(candidates) < 16:
            continue
        rng = random.Random(sample_seed)
        sample = [rng.choice(candidates) for _ in range(512)]
        if tokenizer.encode(tokenizer.decode(sample)) == sample:
            return candidates
    raise ValueError(
        "found no one-token words that round-trip through this tokenizer; cannot build exact-length prompts"
    )


def _rng(*parts: object) -> random.Random:
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


@dataclass(frozen=True)
class WorkloadConfig:
    nonce: str  # unique per invocation: prompts of different runs never share a head
    system_tokens: int = 0  # length of a shared system prompt (0: none)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.system_tokens < 0:
            raise ValueError("system_tokens must be >= 0")
        if not self.nonce:
            raise ValueError("the nonce must not be empty")


class PromptFactory:
    """Builds the experiments' prompts for one tokenizer."""

    def __init__(self, tokenizer: Any, config: WorkloadConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.words = filler_vocabulary(tokenizer, config.seed)
        self.system_ids = self._filler(config.system_tokens, "system")

    def _filler(self, num_tokens: int, tag: str) -> list[int]:
        rng = _rng(self.config.seed, tag)
        return [rng.choice(self.words) for _ in range(num_tokens)]

    def header(self, tag: str) -> str:
        return f"[{self.config.nonce} {tag}]"

    def completion_prompt(self, num_tokens: int, tag: str) -> list[int]:
        """Token ids: shared system prompt, unique header, filler; exactly ``num_tokens`` long."""
        head = self.system_ids + self.tokenizer.encode(self.header(tag))
        if num_tokens <= len(head):
            raise ValueError(f"a prompt of {num_tokens} tokens has no room after its {len(head)}-token head")
        return head + self._filler(num_tokens - len(head), tag)

    def chat_messages(self, num_tokens: int, tag: str) -> list[dict]:
        """Messages whose rendered prompt (with the generation prompt) is exactly ``num_tokens`` tokens."""
        system = [{"role": "system", "content": self.tokenizer.decode(self.system_ids)}] if self.system_ids else []
        filler = self._filler(num_tokens, tag)  # more than enough words; a prefix of them is used
        count = num_tokens - self.count_chat(system + [{"role": "user", "content": self.header(tag)}])
        for _ in range(MAX_FIT_ATTEMPTS):
            if count < 0:
                break
            messages = system + [{"role": "user", "content": self.header(tag) + self.tokenizer.decode(filler[:count])}]
            actual = self.count_chat(messages)
            if actual == num_tokens:
                return messages
            count += num_tokens - actual
        raise ValueError(
            f"could not fit a chat prompt of exactly {num_tokens} tokens (the template and header "
            f"need more, or the tokenizer merges filler words)"
        )

    def user_text(self, num_tokens: int, tag: str) -> str:
        """A follow-up user message of about ``num_tokens`` tokens (exact for the filler part)."""
        return self.tokenizer.decode(self._filler(num_tokens, tag))

    def count_chat(self, messages: list[dict]) -> int:
        return len(self.tokenizer.apply_chat_template(messages))
