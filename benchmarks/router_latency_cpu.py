"""The router's added latency per policy on CPU: a small model that tokenizes like the GPU presets, and the figures.

    PYTHONPATH=$PWD python benchmarks/router_latency_cpu.py model /tmp/small-bpe
    kvshare bench routing --model /tmp/small-bpe ... --out DIR        (docs/results/*-router-latency-cpu/README.md)
    PYTHONPATH=$PWD python benchmarks/router_latency_cpu.py added DIR [DIR ...]

``model`` writes tiny's architecture at a quarter of its width with the 131072-token BPE of the qwen3 presets
(kvshare.engine.bpe): tiny's byte tokenizer cannot be cut into pieces, so its text costs a router what no real
checkpoint's does. ``added`` prints, per condition of each results folder, the router's added latency (a request's
TTFT at the client less the replica's own time to writing its first token: kvshare.bench.routing_summary) as
p50 / p90 / p99 in ms over the measured requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections import defaultdict

from kvshare.bench.routing_summary import router_added_s
from kvshare.bench.stats import percentile


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
        with open(os.path.join(folder, "records.jsonl")) as f:
            for line in f:
                record = Record(**json.loads(line))
                value = router_added_s(record) if record.role == "measure" and record.is_ok else None
                if value is not None:
                    added[record.condition].append(value * 1e3)
        for condition, values in added.items():
            cells = " | ".join(f"{percentile(values, q):.2f}" for q in (50, 90, 99))
            print(f"| {os.path.basename(folder.rstrip('/'))} | {condition} | {len(values)} | {cells} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("model").add_argument("out")
    sub.add_parser("added").add_argument("folders", nargs="+")
    args = p.parse_args()
    if args.what == "model":
        write_model(args.out)
    else:
        print_added(args.folders)


if __name__ == "__main__":
    main()
