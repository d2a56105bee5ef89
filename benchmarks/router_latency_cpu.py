"""The router's added latency per policy on CPU: a small model that tokenizes like the GPU presets, and the figures.

    PYTHONPATH=$PWD python benchmarks/router_latency_cpu.py model /tmp/small-bpe
    kvshare bench routing --model /tmp/small-bpe ... --out DIR        (docs/results/*-router-latency-cpu/README.md)
    PYTHONPATH=$PWD python benchmarks/router_latency_cpu.py added DIR [DIR ...]
    PYTHONPATH=$PWD python benchmarks/router_latency_cpu.py pieces [--model qwen3-8b]
    PYTHONPATH=$PWD python benchmarks/router_latency_cpu.py spans FILE [FILE ...]

``model`` writes tiny's architecture at a quarter of its width with the 131072-token BPE of the qwen3 presets
(kvshare.engine.bpe): tiny's byte tokenizer cannot be cut into pieces, so its text costs a router what no real
checkpoint's does. ``added`` prints, per condition of each results folder, the router's added latency (a request's
TTFT at the client less the replica's own time to writing its first token: kvshare.bench.routing_summary) as
p50 / p90 / p99 in ms over the measured requests (its records.jsonl, or records.jsonl.xz). ``pieces`` prints what
encoding a chat's turns costs a tokenizer per piece size (kvshare.engine.token_cache): six turns of one session
(a 5000-token system prompt, 700-token user turns, 20-token answers) on a fresh cache, the first turn and the
median of the later ones over 5 sessions, and the look-up of a 128k-token text all of whose pieces are held.
``spans`` prints p50 / p90 / p99 of files of one time in ms a line (a router's own time per request, written by
a copy of the router patched as the results folder's spans/spans.patch shows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import os
from collections import defaultdict

from kvshare.bench.routing_summary import router_added_s
from kvshare.stats import percentile


def write_model(out: str) -> None:
    from kvshare.engine import make_model, presets

    tiny = presets.PRESETS["tiny"]
    shape = {"vocab_size": 131072, "num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 256}
    hf = {**tiny.hf_config, **shape, "num_attention_heads": 2, "num_key_value_heads": 1}
    presets.PRESETS["small-bpe"] = dataclasses.replace(tiny, name="small-bpe", hf_config=hf, tokenizer="bpe")
    print(out, make_model.write_model_dir("small-bpe", out))


def print_added(folders: list[str]) -> None:
    from kvshare.bench.records import Record

    print("| folder | condition | requests | added p50 ms | p90 ms | p99 ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for folder in folders:
        added: dict[str, list[float]] = defaultdict(list)
        path = os.path.join(folder, "records.jsonl")
        with open(path) if os.path.exists(path) else lzma.open(path + ".xz", "rt") as f:
            for line in f:
                record = Record(**json.loads(line))
                value = router_added_s(record) if record.role == "measure" and record.is_ok else None
                if value is not None:
                    added[record.condition].append(value * 1e3)
        for condition, values in added.items():
            cells = " | ".join(f"{percentile(values, q):.2f}" for q in (50, 90, 99))
            print(f"| {os.path.basename(folder.rstrip('/'))} | {condition} | {len(values)} | {cells} |")


def print_pieces(model: str) -> None:
    import statistics
    import time

    from kvshare.bench.workload import PromptFactory, WorkloadConfig
    from kvshare.engine.loader import load_tokenizer
    from kvshare.engine.token_cache import TokenCache, TokenCacheConfig

    tok = load_tokenizer(model)
    factory = PromptFactory(tok, WorkloadConfig(nonce="pieces"))
    system = factory.user_text(5000, "system")
    history, texts = [{"role": "system", "content": system}], []
    for turn in range(6):
        user = {"role": "user", "content": factory.user_text(700, f"user{turn}")}
        texts.append(tok.chat_text([*history, user]))
        history += [user, {"role": "assistant", "content": factory.user_text(20, f"answer{turn}")}]
    held = system * 25
    print(f"chat turns of {len(texts[0])}-{len(texts[-1])} characters; the held text {len(held)} characters")
    print("| piece chars | min chars | first turn ms | later turns ms (median) | held 128k-token look-up ms |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    configs = [(8192, 16384), (4096, 0), (2048, 0), (1024, 0), (512, 0)]
    for piece_chars, min_chars in configs:
        config = TokenCacheConfig(piece_chars=piece_chars, min_chars=min_chars)
        enc = load_tokenizer(model, config)
        first, later, lookups = [], [], []
        for _ in range(5):
            enc._pieces.cache = TokenCache(config.max_bytes)  # a fresh cache (as benchmarks/tokenize_cost.py does)
            for k, text in enumerate(texts):
                t0 = time.perf_counter()
                enc.encode_array(text)
                (later if k else first).append(time.perf_counter() - t0)
            enc.encode_array(held)
            t0 = time.perf_counter()
            enc.look_up(held)
            lookups.append(time.perf_counter() - t0)
        cells = [statistics.median(v) * 1e3 for v in (first, later, lookups)]
        print(f"| {piece_chars} | {min_chars} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


def print_spans(files: list[str]) -> None:
    print("| file | requests | p50 ms | p90 ms | p99 ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for path in files:
        with open(path) as f:
            values = [float(line) for line in f if line.strip()]
        cells = " | ".join(f"{percentile(values, q):.2f}" for q in (50, 90, 99))
        print(f"| {os.path.basename(path)} | {len(values)} | {cells} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("model").add_argument("out")
    sub.add_parser("added").add_argument("folders", nargs="+")
    sub.add_parser("pieces").add_argument("--model", default="qwen3-8b", help="a preset or model directory")
    sub.add_parser("spans").add_argument("files", nargs="+")
    args = p.parse_args()
    if args.what == "spans":
        print_spans(args.files)
    elif args.what == "model":
        write_model(args.out)
    elif args.what == "added":
        print_added(args.folders)
    else:
        print_pieces(args.model)


if __name__ == "__main__":
    main()
