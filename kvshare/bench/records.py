"""Every measured request as a record; the results folder that holds them.

A results folder::

    records.jsonl   every request, one JSON object a line (the source of truth; appended)
    records.csv     the same without token ids, logprobs and timelines (rewritten from records.jsonl)
    runs.jsonl      one line per invocation: its arguments, endpoints and stop reason
    report.md       tables (rewritten after each run)
    *.png           plots

Records are appended one *unit* at a time (a unit: the requests that belong together,
e.g. a primed request and its measurement), so an interrupted run leaves only whole
units behind and a resumed run skips the units already recorded.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvshare.outputs import EQUAL, UNKNOWN, OutputCheck


@dataclass
class Record:
    run_id: str
    experiment: str  # ttft | blocks | sessions
    unit: str  # key of the unit this request belongs to (resume skips recorded units)
    condition: str  # ttft: cold|local|cross; blocks: off|on; sessions: "<placement>/<off|on>"
    role: str  # measure | prime | verify
    context_tokens: int  # the length asked for (initial context for sessions)
    url: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    use_pool: bool | None = None
    replica: str | None = None
    block: int | None = None
    position: int | None = None
    session: int | None = None
    turn: int | None = None
    placement: str | None = None
    ttft_s: float | None = None  # first chunk with a generated token (what the tables call TTFT)
    first_text_s: float | None = None  # first chunk with text
    first_chunk_s: float | None = None
    e2e_s: float | None = None
    local_tokens: int | None = None
    pool_tokens: int | None = None
    computed_tokens: int | None = None
    cached_tokens: int | None = None
    pool_kv_bytes: int | None = None  # bytes of KV pages the replica loaded from the pool (its kvshare object)
    pool_state_bytes: int | None = None  # a hybrid's state checkpoint bytes loaded from the pool (0 or None: none)
    deterministic: bool | None = None  # the replica's deterministic mode (its kvshare object); None: not said
    client: str | None = None  # ttft: token_ids (a load generator's ids) | text (a user's chat client); None: ids
    text_overhead: float | None = None  # text rows: TTFT over the same request's as token ids, minus 1
    output_digest: str | None = None
    # the output against the unit's reference request (kvshare.outputs); None: not compared
    matches_reference: bool | None = None  # output token ids equal the reference's
    first_divergence: int | None = None  # index of the first differing output token, when they differ
    output_check: str | None = None  # equal | near-tie | mismatch | unknown (records before it: None)
    divergence_gap: float | None = None  # the reference's top-1 minus top-2 logprob at first_divergence
    reference_token: int | None = None  # the reference's token id at first_divergence
    output_token: int | None = None  # this request's token id at first_divergence
    compared_with: str | None = None  # the reference: cold (ttft) | prime | verify
    error: str | None = None
    started_at: float = 0.0
    token_ids: list[int] | None = field(default=None, repr=False)
    top_logprobs: list[list[float]] | None = field(default=None, repr=False)  # per generated token: the top logprobs
    timeline: dict | None = field(default=None, repr=False)  # the replica's timeline, when asked (bench --timeline)

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    def set_check(self, check: OutputCheck | None, compared_with: str) -> None:
        """Record ``check`` (None: either output is unknown, nothing is recorded)."""
        if check is None:
            return
        self.matches_reference, self.first_divergence, self.output_check = check.is_equal, check.step, check.verdict
        self.divergence_gap, self.reference_token, self.output_token = (
            check.gap,
            check.reference_token,
            check.output_token,
        )
        self.compared_with = compared_with

    def check(self) -> OutputCheck | None:
        """The recorded check; records of the previous version carry only matches_reference and
        first_divergence: a difference there has an unknown gap."""
        if self.output_check is not None:
            return OutputCheck(
                self.output_check,
                self.first_divergence,
                self.divergence_gap,
                self.reference_token,
                self.output_token,
                self.deterministic is True,
            )
        if self.matches_reference is None:
            return None
        return OutputCheck(EQUAL) if self.matches_reference else OutputCheck(UNKNOWN, self.first_divergence)


_NOT_IN_CSV = ("token_ids", "top_logprobs", "timeline")
CSV_FIELDS = [f.name for f in dataclasses.fields(Record) if f.name not in _NOT_IN_CSV]
_FIELD_NAMES = {f.name for f in dataclasses.fields(Record)}


def output_digest(token_ids: list[int] | None) -> str | None:
    if token_ids is None:
        return None
    return hashlib.blake2b(json.dumps(token_ids).encode(), digest_size=8).hexdigest()


class ResultsDir:
    """The files of one results folder; appends are flushed and fsynced per unit."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def append(self, records: Iterable[Record]) -> None:
        lines = "".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in records)
        with open(self.file("records.jsonl"), "a") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())

    def load(self, latest_only: bool = True) -> list[Record]:
        """The records; with ``latest_only``, of each unit only those of the last run that recorded it
        (a unit that failed and was run again counts once)."""
        path = self.file("records.jsonl")
        if not os.path.exists(path):
            return []
        records = []
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill: its unit is incomplete and will be re-run
                records.append(Record(**{k: v for k, v in data.items() if k in _FIELD_NAMES}))
        if not latest_only:
            return records
        last_run = {r.unit: r.run_id for r in records}
        return [r for r in records if r.run_id == last_run[r.unit]]

    def completed_units(self) -> set[str]:
        """Keys of the units recorded without a failed request (a resumed run skips them; it re-runs the rest)."""
        failed = {r.unit for r in self.load() if r.error is not None}
        return {r.unit for r in self.load()} - failed

    def log_run(self, info: dict) -> None:
        with open(self.file("runs.jsonl"), "a") as f:
            f.write(json.dumps(info) + "\n")

    def write_csv(self, records: list[Record] | None = None) -> str:
        records = self.load() if records is None else records
        path = self.file("records.csv")
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            writer.writeheader()
            for r in records:
                row = dataclasses.asdict(r)
                for name in _NOT_IN_CSV:
                    row.pop(name)
                writer.writerow(row)
        return path


def describe_host(device: str = "auto") -> str:
    """The machine, in words, for a result's ``hardware``: CPU model, usable cores, and the GPUs nvidia-smi names
    (not torch: a CUDA context in the measuring process would hold GPU memory through the run); ``device`` "cpu":
    the GPUs are left out."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    text = f"{cpu}, {len(os.sched_getaffinity(0))} cores usable"
    if device == "cpu" or shutil.which("nvidia-smi") is None:
        return text + ", no GPU"
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True, text=True
    )
    return text + ", " + ("; ".join(done.stdout.strip().splitlines()) or "a GPU nvidia-smi did not name")


def tree_commit() -> str | None:
    """The commit of this tree for a result's ``commit``: ``$KVSHARE_COMMIT`` where the tree travels without its
    .git (a GPU machine gets a copy), else git's short hash with "+changes" when tracked files differ from it; None
    where neither says."""
    if os.environ.get("KVSHARE_COMMIT"):
        return os.environ["KVSHARE_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if out.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() + ("+changes" if dirty else "")
