"""The routing workload's results folder over every invocation that wrote to it.

Several invocations may share one ``--out``, each a fresh cluster replaying some runs, rates or conditions (a GPU
command at a time); the report is rebuilt from every row of the folder, never only from the last invocation's::

    runs.jsonl      one line per invocation, written before its first replay: command, commit, config, its runs
    routing.jsonl   one row per replay, whichever invocation wrote it   -->  summary.json, routing.md (rebuilt)

A replay is named by (rate, condition, run). A name replayed again (a command cut short and run again with the same
``--run-index``) counts once: its last row, as records.jsonl keeps a unit's last run. Every invocation of a folder
must replay the same trace on the same cluster (what ``workload_of`` keeps); one that does not is refused, since
their rows would be pooled into intervals that mean nothing.
"""

from __future__ import annotations

import json

from kvshare.bench.records import ResultsDir
from kvshare.bench.routing_summary import markdown, summarize

EXPERIMENT = "routing"
ROWS = "routing.jsonl"
# what the invocations of one folder may choose for themselves; the rest of config and target must be equal
PER_INVOCATION = ("rates", "conditions", "num_runs", "num_verify")


def _lines(path: str) -> list[dict]:
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill: its replay is incomplete and is not counted
    return out


def load_rows(results: ResultsDir) -> list[dict]:
    """Every replay's row in the folder; of a (rate, condition, run) replayed more than once, the last."""
    rows: dict[tuple, dict] = {}
    for row in _lines(results.file(ROWS)):
        rows[(row["rate"], row["condition"], row["run"])] = row
    return list(rows.values())


def load_invocations(results: ResultsDir) -> list[dict]:
    """The invocations of this workload that wrote to the folder, in order (runs.jsonl)."""
    return [meta for meta in _lines(results.file("runs.jsonl")) if meta.get("experiment") == EXPERIMENT]


def next_run(results: ResultsDir) -> int:
    """The first run number no row of the folder uses."""
    return 1 + max((row["run"] for row in load_rows(results)), default=-1)


LATER_TARGET_FIELDS = {"engine": "builtin", "max_model_len": None}


def workload_of(meta: dict) -> dict:
    """What every invocation of one folder must share: the trace's config and the cluster, as JSON would hold them."""
    config = {k: v for k, v in meta["config"].items() if k not in PER_INVOCATION}
    # a field the target gained later reads as its default in a folder written before it
    target = {**LATER_TARGET_FIELDS, **meta["target"]}
    target = {k: v for k, v in target.items() if k not in ("log_level", "vllm_python")}
    return json.loads(json.dumps({"config": config, "target": target}))


def check_same_workload(results: ResultsDir, meta: dict) -> None:
    """Refuses ``meta`` (ValueError) when an earlier invocation of the folder replayed another workload."""
    mine = workload_of(meta)
    for earlier in load_invocations(results):
        theirs = workload_of(earlier)
        for part in ("config", "target"):
            for name in sorted(set(mine[part]) | set(theirs[part])):
                if mine[part].get(name) != theirs[part].get(name):
                    raise ValueError(
                        f"{results.path} holds runs of another workload ({name}: {theirs[part].get(name)!r} there, "
                        f"{mine[part].get(name)!r} here); give another --out"
                    )


def folder_meta(invocations: list[dict], rows: list[dict]) -> dict:
    """What the report says ran: every invocation's command and commit, the hardware, the sizes, the runs."""
    return {
        "commands": [m.get("command") for m in invocations],
        "commits": list(dict.fromkeys(m.get("commit") for m in invocations)),
        "hardware": list(dict.fromkeys(m.get("hardware") for m in invocations)),
        "sizes": invocations[-1].get("sizes") if invocations else None,
        "num_runs": len({row["run"] for row in rows}),
    }


def write_summary(results: ResultsDir) -> tuple[list[dict], str]:
    """summary.json and routing.md from every row of the folder; (the summary, the report's path)."""
    rows, invocations = load_rows(results), load_invocations(results)
    summary = summarize(rows)
    meta = folder_meta(invocations, rows)
    with open(results.file("summary.json"), "w") as f:
        json.dump({"meta": meta, "invocations": invocations, "summary": summary}, f, indent=1)
    path = results.file("routing.md")
    with open(path, "w") as f:
        f.write(markdown(summary, meta))
    return summary, path
