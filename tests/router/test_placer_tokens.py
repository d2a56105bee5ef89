"""pool_aware's placer encodes of a chat's next turn only what earlier prompts did not hold, with the same ids."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from kvshare.engine.loader import load_tokenizer
from kvshare.router.event_feed import PLACER_PIECE_CHARS, attach_pool_aware
from kvshare.router.policy import RouteFacts
from kvshare.router.pool_aware import PoolAwareConfig, PromptText

MODEL = "qwen3-8b"  # a preset with the 131072-token BPE (its texts can be cut; no weights are built here)


WORDS = ("route", "pool", "chunk", "Replica", "prefix,", "cache.", "7", "naïve")


def _words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def test_a_next_turn_encodes_only_its_new_text_and_the_ids_are_a_whole_encode():
    """Fails when the router's tokenizer keeps a replica's defaults (``load_tokenizer(config.model)``): a prompt
    under 16 KiB is then encoded whole on every turn, the 9-10 KiB system prompt included."""
    rng = random.Random(0)
    config = PoolAwareConfig(endpoint="ipc:///nonexistent/pool", model=MODEL)
    placer = attach_pool_aware(SimpleNamespace(num_replicas=2), config, CollectorRegistry())
    tokenizer = placer.tokenizer
    system = {"role": "system", "content": _words(rng, 1500)}
    first = [system, {"role": "user", "content": _words(rng, 80)}]
    later = [*first, {"role": "assistant", "content": _words(rng, 20)}, {"role": "user", "content": _words(rng, 80)}]
    first_text, later_text = tokenizer.chat_text(first), tokenizer.chat_text(later)
    assert len(later_text) < 16384 and later_text.startswith(first_text[:-40])

    placed = asyncio.run(placer.encoded(RouteFacts(prompt_ids=PromptText(first_text))))  # the first turn placed
    lookup = tokenizer.look_up(later_text)
    new_chars = len(later_text) - len(first_text) + 40  # the generation prompt's tail differs
    assert lookup.num_missing_chars <= new_chars + 2 * PLACER_PIECE_CHARS < len(later_text) // 2

    whole = load_tokenizer(MODEL)  # a replica's tokenizer: one plain encode of each text this short
    assert placed.prompt_ids.tolist() == whole.encode(first_text)
    assert tokenizer.encode_missing(lookup).tolist() == whole.encode(later_text)
