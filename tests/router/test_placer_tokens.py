"""pool_aware's placer encodes of a chat's next turn only what earlier prompts did not hold, and places it before
that is encoded; the ids are those of a whole encode."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from kvshare.engine.loader import load_tokenizer
from kvshare.router.chunk_chain import chain
from kvshare.router.policy import RouteFacts
from kvshare.router.pool_aware import PoolAwareConfig, PoolAwarePlacer
from kvshare.router.prompt_ids import DEFER_MAX_CHARS, PLACER_PIECE_CHARS, PromptText
from kvshare.serve.off_loop import OFF_LOOP_MIN_CHARS
from tests.serve.test_off_loop import BlockedEncode

MODEL = "qwen3-8b"  # a preset with the 131072-token BPE (its texts can be cut; no weights are built here)


WORDS = ("route", "pool", "chunk", "Replica", "prefix,", "cache.", "7", "naïve")


def _words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def test_a_next_turn_encodes_only_its_new_text_and_the_ids_are_a_whole_encode():
    """Fails when the router's tokenizer keeps a replica's defaults (``load_tokenizer(config.model)``): a prompt
    under 16 KiB is then encoded whole on every turn, the 9-10 KiB system prompt included."""
    rng = random.Random(0)
    config = PoolAwareConfig(endpoint="ipc:///nonexistent/pool", model=MODEL)
    placer = PoolAwarePlacer.from_config(config, num_replicas=2)
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


def test_a_next_turn_is_placed_while_its_new_tail_encodes_and_remembered_whole_after():
    """Fails when the placement waits for the whole prompt's ids (``encoded`` awaiting the encode of what no
    earlier prompt held, as before KnownPrefix): the placement is not done while that encode is held."""
    rng = random.Random(1)
    placer = PoolAwarePlacer.from_config(PoolAwareConfig(endpoint="ipc:///x", model=MODEL), num_replicas=2)
    placer.feed.last_seq = 0  # events live (an empty pool): placed by T_r
    tokenizer, whole = placer.tokenizer, load_tokenizer(MODEL)
    first = [{"role": "system", "content": _words(rng, 2500)}, {"role": "user", "content": _words(rng, 50)}]
    later = [*first, {"role": "assistant", "content": _words(rng, 20)}, {"role": "user", "content": _words(rng, 800)}]
    first_text, later_text = tokenizer.chat_text(first), tokenizer.chat_text(later)
    tail_chars = len(later_text) - len(first_text)
    assert OFF_LOOP_MIN_CHARS <= tail_chars < DEFER_MAX_CHARS - PLACER_PIECE_CHARS  # long enough to be held below

    async def turns():
        placed = await placer.encoded(RouteFacts(prompt_ids=PromptText(first_text)))  # new to the router: whole
        home = placer.order(placed.prompt_ids, None, [0, 0], [True, True], 0, 0.0)[0]
        blocked = BlockedEncode(tokenizer.encode_missing)
        tokenizer.encode_missing = blocked
        task = asyncio.create_task(placer.encoded(RouteFacts(prompt_ids=PromptText(later_text))))
        try:
            assert await asyncio.get_running_loop().run_in_executor(None, blocked.entered.wait, 60)
            await asyncio.sleep(0)
            is_placed_first = task.done()
            known = task.result() if is_placed_first else None
            order = placer.order(known.prompt_ids, None, [0, 0], [True, True], 1, 0.0) if known else None
        finally:
            blocked.release.set()
        if known is None:  # placed only once the whole prompt was encoded
            return False, home, None, None, (await task).prompt_ids
        ids = await known.prompt_ids.whole
        await asyncio.sleep(0)  # the callback that remembers the whole chain
        return is_placed_first, home, order, known.prompt_ids, ids

    is_placed_first, home, order, known, ids = asyncio.run(turns())
    assert is_placed_first and order[0] == home  # placed on the replica holding the first turn, encode held
    expected = whole.encode(later_text)
    assert ids.tolist() == expected and known.ids.tolist() == expected[: len(known.ids)]
    assert len(first_text) - 2 * PLACER_PIECE_CHARS < len(tokenizer.decode(known.ids, skip_special_tokens=False))
    assert abs(known.num_tokens - len(expected)) < 0.1 * len(expected)  # the tail's length estimated
    hashes = chain(ids, placer.feed.index.chunk_tokens, None)
    assert len(placer.sent.depths(home, hashes)) == len(hashes)  # remembered whole once encoded


def test_a_tail_whose_encode_failed_leaves_its_known_chunks_remembered():
    """Fails when a failed tail encode leaves the placed prompt out of the sent memory (the callback raising, or
    remembering nothing): its known chunks were sent to the replica all the same."""
    from kvshare.router.prompt_ids import KnownPrefix

    placer = PoolAwarePlacer.from_config(PoolAwareConfig(endpoint="ipc:///x", model=MODEL), num_replicas=2)
    placer.feed.last_seq = 0
    chunk_tokens = placer.feed.index.chunk_tokens
    known_ids = np.arange(2 * chunk_tokens + 7, dtype=np.int64)

    async def place() -> int:
        whole = asyncio.get_running_loop().create_future()
        first = placer.order(KnownPrefix(known_ids, 4 * chunk_tokens, whole), None, [0, 0], [True, True], 0, 0.0)[0]
        whole.set_exception(RuntimeError("the tokenizer failed"))
        await asyncio.sleep(0)
        return first

    first = asyncio.run(place())
    # its 2 full chunks remembered, the head used last
    assert placer.sent.depths(first, chain(known_ids, chunk_tokens, None)) == [0, 1]
