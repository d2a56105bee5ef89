"""How long a replica takes to read a token-id completion body into the int64 array the engine takes
(issue 18: 9-17 ms of a 131k-262k-token request's TTFT on the H200's host went to the parse).

Per prompt length: ``decode_completion`` (the list cut out of the body and read by numpy on up to
``token_ids.PARSE_THREADS`` threads, msgspec decoding the rest: kvshare.serve.token_ids) against references
measured in the same run: the same on 1, 2, 4 and 8 threads; session 12's reader (msgspec checks the whole body, the
list handed over raw and read by ``np.fromstring``); and a typed ``list[int]`` decode with ``np.fromiter``
(before session 10). Best of 20, milliseconds, and the ratios. Runs anywhere (CPU only).

    PYTHONPATH=. python3 benchmarks/diagnostics/diag_parse.py [LENGTHS]      e.g. 32768,131072,262144
"""
import json
import sys
import time

import msgspec
import numpy as np

from kvshare.serve import api_types as A
from kvshare.serve import token_ids as T


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

        def session12():
            raw = bytes(msgspec.json.decode(body, type=A.TokenIdsCompletionRequest).prompt)
            inner = raw[1:-1]
            assert not inner.translate(None, b"0123456789, \t\r\n")
            np.fromstring(inner, dtype=np.int64, sep=",")

        def on(threads: int) -> float:
            default, T.PARSE_THREADS = T.PARSE_THREADS, threads
            try:
                return best_ms(lambda: A.decode_completion(body))
            finally:
                T.PARSE_THREADS = default

        old, s12 = best_ms(before), best_ms(session12)
        by_threads = {k: round(on(k), 2) for k in sorted({1, 2, 4, 8, T.PARSE_THREADS})}
        new = best_ms(lambda: A.decode_completion(body))
        print(json.dumps({"tokens": n, "body_MB": round(len(body) / 1e6, 2), "before_ms": round(old, 2),
                          "session12_ms": round(s12, 2), "now_ms": round(new, 2), "parse_threads": T.PARSE_THREADS,
                          "ms_by_threads": by_threads, "now_over_session12": round(new / s12, 3),
                          "now_over_one_thread": round(new / by_threads[1], 3)}), flush=True)


if __name__ == "__main__":
    main()
