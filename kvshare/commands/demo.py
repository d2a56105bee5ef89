"""The embedded default: start a pool and client processes, share pages between them, measure."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="kvshare-report", help="folder for the demo's report")


def run(args: argparse.Namespace) -> int:
    from kvshare.demo import run_demo

    return run_demo(args)
