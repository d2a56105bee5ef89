"""Stop-string matching over a long generation: kvshare.serve.detokenize.TextStream per token.

    python benchmarks/stop_strings_bench.py                    # 32768 tokens, 16 stop strings, byte tokenizer
    python benchmarks/stop_strings_bench.py --tokens 8192 --json
    python benchmarks/stop_strings_bench.py --stops 1 --stop-chars 20000   # one long stop string

The generation is fed one token at a time, as the server does, through the byte-level tokenizer's
HF decoder (kvshare.engine.tokenizer), with stop strings that never occur, so every token is checked
against all of them. ``--with-full-rescan`` also times the form that decodes and searches the whole
text on every token (the quadratic baseline), on the same tokens.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc


def full_rescan(decode, stops: list[str], token_ids: list[int]) -> str:
    """The baseline: every token decodes all ids so far and searches the whole text for every stop string."""
    ids: list[int] = []
    text = ""
    for token_id in token_ids:
        ids.append(token_id)
        text = decode(ids)
        if any(text.find(stop) >= 0 for stop in stops):
            break
    return text


def main() -> None:
    from kvshare.engine.tokenizer import Tokenizer
    from kvshare.serve.detokenize import TextStream

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--stops", type=int, default=16)
    parser.add_argument("--stop-chars", type=int, default=0, help="pad each stop string to this many characters")
    parser.add_argument("--with-full-rescan", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    tok = Tokenizer.byte_level(args.tokens + 16)
    words = "the shared pool keeps what one replica computed; naïve café über 世界 "
    token_ids = tok.encode(words * (args.tokens // len(words.encode()) + 1))[: args.tokens]
    stops = [f"<|stop {i}|>".ljust(args.stop_chars, "~") for i in range(args.stops)]
    started = time.perf_counter()
    stream = TextStream(tok.decode, stops)
    out = "".join(stream.add(i) for i in token_ids) + stream.finish()
    seconds = time.perf_counter() - started
    tracemalloc.start()  # a second pass for the memory it takes (tracing slows it)
    traced = TextStream(tok.decode, stops)
    "".join(traced.add(i) for i in token_ids)
    peak_bytes = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out == tok.decode(token_ids) and not stream.is_stopped
    result = {
        "tokens": args.tokens,
        "stop_strings": args.stops,
        "stop_chars": max((len(stop) for stop in stops), default=0),
        "seconds": round(seconds, 4),
        "us_per_token": round(seconds / args.tokens * 1e6, 2),
        "chars": len(out),
        "chars_scanned": stream.num_scanned,
        "peak_mib": round(peak_bytes / 2**20, 1),
    }
    if args.with_full_rescan:
        started = time.perf_counter()
        full_rescan(tok.decode, stops, token_ids)
        result["full_rescan_seconds"] = round(time.perf_counter() - started, 3)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
