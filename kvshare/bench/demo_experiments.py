"""The study's experiments at small scale, for ``kvshare demo`` (tiny model on CPU, 2 replicas).

    from kvshare.bench.demo_experiments import run_demo_experiments
    outcome = run_demo_experiments(cluster, "kvshare-report/bench", scale="small")

``small`` uses contexts where the tiny model's cold prefill on CPU (seconds at 8k tokens)
is well over 10x the pool load (milliseconds), and takes a few minutes on 2 cores;
``smoke`` is the seconds-long variant the tests run.
"""

from __future__ import annotations

from typing import Any

from kvshare.bench.blocks import BlocksConfig
from kvshare.bench.harness import Harness, HarnessConfig, HarnessOutcome
from kvshare.bench.replicas import FixedReplicas
from kvshare.bench.report import print_tables
from kvshare.bench.sessions import SessionsConfig
from kvshare.bench.ttft import TTFTConfig

SCALES = {
    "small": (
        TTFTConfig(contexts=(2000, 8000), repetitions=1, max_tokens=16),
        BlocksConfig(contexts=(8000,), per_block=2, max_tokens=16, verify=1),
        SessionsConfig(contexts=(8000,), num_sessions=1, num_turns=6, turn_tokens=128, answer_tokens=16, verify=1),
    ),
    "smoke": (
        TTFTConfig(contexts=(512, 1024), repetitions=1, max_tokens=8),
        BlocksConfig(contexts=(1024,), per_block=1, max_tokens=8, verify=1),
        SessionsConfig(contexts=(1024,), num_sessions=1, num_turns=3, turn_tokens=64, answer_tokens=8, verify=1),
    ),
}


def run_demo_experiments(
    target: Any,
    out_dir: str,
    scale: str = "small",
    console: Any = None,
    tokenizer: str | None = None,
    show_progress: bool = True,
) -> HarnessOutcome:
    """Run ttft, blocks and sessions at ``scale`` against ``target`` and print the tables.

    ``target``: a started ``kvshare.launch.Cluster`` (its replicas are used directly; the
    sessions place turns with the router's own policy code) or a list of replica URLs.
    ``tokenizer``: model directory or preset of the served model (default: the cluster's
    model, else the served model's name). Results go to ``out_dir`` (report.md, records,
    plots); a second call with the same ``out_dir`` resumes instead of repeating.
    """
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    urls = list(getattr(target, "replica_urls", target))
    if tokenizer is None and hasattr(target, "config"):
        tokenizer = target.config.model
    harness = Harness(
        HarnessConfig(out_dir=out_dir, tokenizer=tokenizer, show_progress=show_progress),
        FixedReplicas(urls),
        console=console,
    )
    outcome = harness.run(list(SCALES[scale]))
    print_tables(outcome.tables, console)
    return outcome
