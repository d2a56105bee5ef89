"""The table of ``before_after_cpu.sh``: per figure and tree, the median over the rounds and their spread.

    python benchmarks/before_after_table.py OUT "LABEL 1" "LABEL 2"

Reads ``OUT/t{0,1}/r{N}/``: ``demo/bench/records.jsonl`` (``kvshare demo``), ``vllm/ttft.json`` (the vLLM
connector's bench) and ``loadavg``. A round's figure is the median of that run's requests:

    builtin cross   the built-in engine, 1024 tokens, replica B's requests whose prefix it loaded from the pool
                    (the ttft experiment's cross request and the blocks' measured ON requests)
    builtin cold    the same prompts' length computed cold (the ttft experiment's cold request, the blocks' OFF)
    vllm cross_B    vLLM CPU with the connector: B loads what A stored
    vllm cold_A     A computes (and stores) the same prompt
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

CONTEXT = 1024  # the demo's smoke scale measures cross-replica reuse at this length


def builtin_figures(records_path: Path) -> dict[str, float]:
    cross, cold = [], []
    for line in records_path.read_text().splitlines():
        r = json.loads(line)
        if r["role"] != "measure" or r["context_tokens"] != CONTEXT or r.get("error"):
            continue
        if (r["experiment"], r["condition"]) in (("ttft", "cross"), ("blocks", "on")) and r["pool_tokens"] > 0:
            cross.append(r["ttft_s"])
        elif (r["experiment"], r["condition"]) in (("ttft", "cold"), ("blocks", "off")):
            cold.append(r["ttft_s"])
    figures = {}
    if cross:
        figures["builtin cross"] = statistics.median(cross)
    if cold:
        figures["builtin cold"] = statistics.median(cold)
    return figures


def vllm_figures(ttft_path: Path) -> dict[str, float]:
    rows = json.loads(ttft_path.read_text())["rows"]
    cross = [row["cross_B"] for row in rows if row["cross_B_cached"] > 0]  # a load, not a recompute
    cold = [row["cold_A"] for row in rows]
    figures = {}
    if cross:
        figures["vllm cross_B"] = statistics.median(cross)
    if cold:
        figures["vllm cold_A"] = statistics.median(cold)
    return figures


def run_figures(run_dir: Path) -> dict[str, float]:
    figures: dict[str, float] = {}
    records = run_dir / "demo" / "bench" / "records.jsonl"
    if records.exists():
        figures.update(builtin_figures(records))
    ttft = run_dir / "vllm" / "ttft.json"
    if ttft.exists():
        figures.update(vllm_figures(ttft))
    load = run_dir / "loadavg"
    if load.exists():
        figures["load average"] = float(load.read_text().split()[0])
    return figures


def table(out: Path, labels: list[str]) -> str:
    per_tree = []
    for index in range(len(labels)):
        runs = sorted((out / f"t{index}").glob("r*"), key=lambda p: int(p.name[1:]))
        per_tree.append([run_figures(run) for run in runs])
    names = ["builtin cross", "builtin cold", "vllm cross_B", "vllm cold_A", "load average"]
    lines = [f"tree {i + 1}: {label}" for i, label in enumerate(labels)]
    lines += ["", "| figure | " + " | ".join(f"tree {i + 1}: median (min - max), n" for i in range(len(labels))) + " |"]
    lines.append("| --- |" + " --- |" * len(labels))
    for name in names:
        cells = []
        for runs in per_tree:
            values = [run[name] for run in runs if name in run]
            if not values:
                cells.append("-")
                continue
            unit, scale = ("", 1.0) if name == "load average" else (" ms", 1000.0)
            med, low, high = (scale * v for v in (statistics.median(values), min(values), max(values)))
            cells.append(f"{med:.1f}{unit} ({low:.1f} - {high:.1f}), {len(values)}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    print(table(Path(sys.argv[1]), sys.argv[2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
