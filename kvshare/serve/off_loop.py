"""Work a handler hands to a thread so that the other streams of its event loop never wait for it.

A replica's event loop writes the token deltas of every running request and answers /health and /metrics; a
router's relays every response. Work that grows with one request's size (encoding its prompt's text, answering
/tokenize) would stall all of them for as long as it runs on the loop, so it runs on the loop's default executor:
the tokenizer's encode releases the GIL (its Rust side, ``encode_batch`` on its own threads), so the loop goes on.

Short texts stay on the loop: the hop to a thread and back costs 60-65 us (median, 2 CPU cores), and an uncached
encode of the presets' BPE 0.38 us a character (1 KiB 0.39 ms, 4 KiB 1.5 ms; ``python
benchmarks/tokenize_cost.py --loop``). Below ``OFF_LOOP_MIN_CHARS`` the stall saved is at most ~1.5 ms of the
loop and the hop would add 4% or more to the request's own encode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
OFF_LOOP_MIN_CHARS = 4096  # characters of text: from here on an encode runs on a thread


async def off_loop(fn: Callable[..., T], *args, num_chars: int | None = None) -> T:
    """``fn(*args)`` on a thread of the running loop's default executor; its result, or its exception raised here
    as it was raised there. ``num_chars``: the characters of text ``fn`` encodes; below ``OFF_LOOP_MIN_CHARS``
    it runs on the loop (None: always on a thread)."""
    if num_chars is not None and num_chars < OFF_LOOP_MIN_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
