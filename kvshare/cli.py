"""The ``kvshare`` command: one subcommand per module in kvshare.commands.

Command modules are light to import (argument definitions only); each one's
``run`` imports the heavy parts it needs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import kvshare
from kvshare.commands import DefaultsHelpFormatter
from kvshare.errors import UserError

# subcommand -> module under kvshare.commands (each has add_arguments(parser) and run(args) -> int)
COMMANDS = {
    "pool": ("pool", "run the pool daemon (owns the shared arena)"),
    "pool-stats": ("pool_stats", "print a running pool's stats as JSON"),
    "pool-admin": ("pool_admin", "administer a running pool: flush chunks, list leases and namespaces"),
    "serve": ("serve", "run one replica (built-in engine, OpenAI API)"),
    "route": ("route", "run the router in front of replicas"),
    "up": ("up", "start the pool, N replicas and the router together"),
    "plan": ("plan", "size a pool: KV bytes per token and the pool for N cached tokens"),
    "bench": ("bench", "benchmarks: pool, parse, ttft, blocks, sessions, suite, routing; report"),
    "demo": ("demo", "the embedded default: a small cluster on CPU and the study's experiments"),
    "make-model": ("make_model", "write a synthetic preset as a Hugging Face model directory"),
    "generate": ("generate", "run one prompt through the built-in engine"),
    "load": ("load", "bounded load through a router, answers checked against pool-off references"),
    "validate": ("validate", "validate this machine and deployment: bytes, helpers, full pool, service"),
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """A logging level name, in any case (``--log-level debug``)."""
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level; choose one of {', '.join(LOG_LEVELS)}")
    return level


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvshare", description=kvshare.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvshare {kvshare.__version__}")
    parser.add_argument("--log-level", type=log_level, default="INFO", help=", ".join(LOG_LEVELS))
    # the same flag after the subcommand (`kvshare serve --log-level debug`); given there, it wins
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", type=log_level, default=argparse.SUPPRESS, help=", ".join(LOG_LEVELS))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(f"kvshare.commands.{module}")
        command = sub.add_parser(
            name,
            help=help_text,
            description=(mod.__doc__ or help_text).strip(),
            parents=[common],
            formatter_class=DefaultsHelpFormatter,
        )
        mod.add_arguments(command)
        command.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # matplotlib's INFO lines (the font cache it builds on first use) say nothing about kvshare's run
    logging.getLogger("matplotlib").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except UserError as exc:
        print(f"kvshare {args.command}: error: {exc}", file=sys.stderr)
        return 2
