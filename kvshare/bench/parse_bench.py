"""``kvshare bench parse``: how long a replica takes to read a token-id completion body.

A prompt of token ids arrives as JSON text of 1-2 MB at 128k-256k tokens; the replica cuts the
list out of the body and reads it with numpy on up to ``api_types.PARSE_THREADS`` threads
(kvshare.serve.api_types). Per prompt length this times that read on 1, 2, 4 and 8 threads and
against a typed ``list[int]`` decode with ``np.fromiter`` of the same body, best of ``repeats``,
in milliseconds. Every body is checked to decode to the ids it was built from. CPU only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

THREAD_COUNTS = (1, 2, 4, 8)
VOCAB_SIZE = 151_936  # Qwen3's: ids of six digits, as long prompts of that model have


@dataclass(frozen=True)
class ParseBenchConfig:
    lengths: tuple[int, ...] = (32768, 131072, 262144)
    repeats: int = 20

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"prompt lengths must be positive token counts, got {self.lengths}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def run_parse_bench(config: ParseBenchConfig) -> list[dict]:
    """One row per prompt length: milliseconds of the replica's read by thread count and of the typed decode."""
    import msgspec
    import numpy as np

    from kvshare.serve import api_types as A

    class ListPrompt(msgspec.Struct):
        prompt: list[int]

    rng = np.random.default_rng(0)
    rows = []
    for n in config.lengths:
        ids = rng.integers(0, VOCAB_SIZE, n)
        body = json.dumps({"model": "m", "prompt": ids.tolist(), "max_tokens": 16, "stream": True}).encode()
        if not np.array_equal(A.prompt_of(A.decode_completion(body)), ids):
            raise RuntimeError(f"a {n}-token body did not decode to its ids")

        def typed() -> None:
            prompt = msgspec.json.decode(body, type=ListPrompt).prompt
            np.fromiter(prompt, dtype=np.int64, count=len(prompt))

        def on(threads: int) -> float:
            default, A.PARSE_THREADS = A.PARSE_THREADS, threads
            try:
                return best_ms(lambda: A.decode_completion(body), config.repeats)
            finally:
                A.PARSE_THREADS = default

        by_threads = {k: round(on(k), 3) for k in sorted({*THREAD_COUNTS, A.PARSE_THREADS})}
        rows.append(
            {
                "tokens": n,
                "body_bytes": len(body),
                "parse_threads": A.PARSE_THREADS,
                "ms_by_threads": by_threads,
                "default_ms": by_threads[A.PARSE_THREADS],
                "typed_list_ms": round(best_ms(typed, config.repeats), 3),
            }
        )
    return rows
