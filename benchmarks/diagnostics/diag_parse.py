"""How long a replica takes to read a token-id completion body into the int64 array the engine takes
(issue 18: 9-14 ms of a 131k-token request's TTFT on the H200's host went to the parse).

Per prompt length: ``decode_completion`` (msgspec checks the JSON, numpy reads the list on up to
``PARSE_THREADS`` threads) against references measured in the same run: the same on one thread, and a typed
``list[int]`` decode and ``np.fromiter`` (what the replica did before); best of 20, milliseconds, and the ratios. Runs anywhere (CPU only).

    PYTHONPATH=. python3 benchmarks/diagnostics/diag_parse.py [LENGTHS]      e.g. 32768,131072,262144
"""
import json
import sys
import time

import msgspec
import numpy as np

from kvshare.serve import api_types as A


class _ListPrompt(msgspec.Struct):  # the reference: the typed decode the replica used before
    prompt: list[int]


def best_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    lengths = [int(n) for n in (sys.argv[1] if len(sys.argv) > 1 else "32768,131072,262144").split(",")]
    rng = np.random.default_rng(0)
    for n in lengths:
        ids = rng.integers(0, 151_936, n)
        body = json.dumps({"model": "m", "prompt": ids.tolist(), "max_tokens": 16, "stream": True}).encode()
        assert np.array_equal(A.prompt_of(A.decode_completion(body)), ids)

        def before():
            prompt = msgspec.json.decode(body, type=_ListPrompt).prompt
            np.fromiter(prompt, dtype=np.int64, count=len(prompt))

        def one_thread():
            threads, A.PARSE_THREADS = A.PARSE_THREADS, 1
            try:
                A.prompt_of(A.decode_completion(body))
            finally:
                A.PARSE_THREADS = threads

        old, single = best_ms(before), best_ms(one_thread)
        new = best_ms(lambda: A.prompt_of(A.decode_completion(body)))
        print(json.dumps({"tokens": n, "body_MB": round(len(body) / 1e6, 2), "before_ms": round(old, 2),
                          "one_thread_ms": round(single, 2), "now_ms": round(new, 2),
                          "parse_threads": A.PARSE_THREADS, "now_over_before": round(new / old, 3),
                          "now_over_one_thread": round(new / single, 3)}), flush=True)


if __name__ == "__main__":
    main()
