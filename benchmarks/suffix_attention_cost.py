"""What a prefill costs with a prefix already in the KV, against a cold prefill of the same prompt.

    PYTHONPATH=$PWD python benchmarks/suffix_attention_cost.py [--lengths 256,2048,8192] [--in-place 0,1,16,0.5]
    PYTHONPATH=$PWD python benchmarks/suffix_attention_cost.py --whole --lengths 2048   # the whole forward

For each prompt length n and tokens in place o (a count, or a share of n below 1), one layer's attention
(kvshare.engine.model.attend) over the preset's heads, or with ``--whole`` the preset's whole forward on CPU
(random weights): o = 0 is the cold prefill (plain causal), o > 0 the suffix of n - o queries over n keys with a
lower-right causal mask (what a reused prefix's suffix runs). Best of --repeats, the tokens in place interleaved.
This is the cost behind the in-place floor of kvshare.engine.kv_cache.HeldSequence: an overlap below a chunk is reused
only where it is at least half the prompt.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    import torch

    from kvshare.engine.model import attend
    from kvshare.engine.presets import PRESETS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="256,2048,8192")
    parser.add_argument("--in-place", default="0,1,16,0.5", help="tokens in place: counts, or shares of n below 1")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--whole", action="store_true", help="time the whole forward, not one layer's attention")
    args = parser.parse_args()

    config = PRESETS[args.preset].config
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    engine = None
    if args.whole:
        from kvshare.engine.engine import Engine, EngineConfig

        engine = Engine(
            EngineConfig(model=args.preset, local_cache_bytes=0, max_model_len=config.max_position_embeddings)
        )
    for n in (int(x) for x in args.lengths.split(",")):
        k, v = torch.randn(kv_heads, n, head_dim), torch.randn(kv_heads, n, head_dim)
        ids = torch.randint(0, min(config.vocab_size, 256), (n,))
        kv = engine._kv.ensure(n) if engine is not None else None
        in_place = [int(float(x) * n) if float(x) < 1 else int(x) for x in args.in_place.split(",")]
        best = {o: float("inf") for o in in_place}
        for _ in range(args.repeats):
            for o in in_place:
                q = torch.randn(heads, n - o, head_dim)
                started = time.perf_counter()
                with torch.inference_mode():
                    engine.model(ids[o:], kv, o) if engine is not None else attend(q, k, v, o)
                best[o] = min(best[o], time.perf_counter() - started)
        row = {"tokens": n, **{f"in_place_{o}_ms": round(best[o] * 1e3, 2) for o in in_place}}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
