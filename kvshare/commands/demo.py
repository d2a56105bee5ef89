"""The embedded default: the pool, then a small cluster on CPU (tiny model, two replicas, a router)
running the study's experiments at small scale; prints the tables and writes a report."""

from __future__ import annotations

import argparse

from kvshare.commands import tcp_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="kvshare-report", help="folder for the demo's report")
    p.add_argument(
        "--scale",
        choices=("small", "smoke"),
        default="small",
        help="small: contexts up to 8k tokens, a few minutes; smoke: seconds",
    )
    p.add_argument(
        "--model",
        default="tiny",
        help="the replicas' model: a preset that runs on CPU (tiny; qwen3.5-tiny, the Qwen3.5 hybrid, which shares "
        "its GDN state's checkpoints through the pool beside the KV) or a model directory",
    )
    p.add_argument("--replicas", type=int, default=2, help="replicas of the cluster it starts")
    p.add_argument("--port", type=tcp_port, default=8080, help="router port; replicas take the next ports")


def run(args: argparse.Namespace) -> int:
    from kvshare.demo import run_demo

    return run_demo(args)
