"""Work a handler hands to a thread so that the other streams of its event loop never wait for it.

A replica's event loop writes the token deltas of every running request and answers /health and /metrics; a
router's relays every response. Work that grows with one request's size (encoding its prompt's text, answering
/tokenize) would stall all of them for as long as it runs on the loop, so it runs on the loop's default executor:
the tokenizer's encode releases the GIL (its Rust side, ``encode_batch`` on its own threads), so the loop goes on.

Short texts stay on the loop: the hop to a thread and back costs 60-145 us (median of 200 on 2 CPU cores, quiet to
loaded), an uncached encode of the presets' BPE 0.4-0.5 ms a KiB of text (4 KiB: 1.5-1.9 ms; ``python
benchmarks/tokenize_cost.py --loop``, docs/results/2026-12-05-6a47132-text-off-loop-cpu). Below
``OFF_LOOP_MIN_CHARS`` the stall saved is under ~2 ms of the loop and the hop would add 3-10% to the encode it moves.
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
