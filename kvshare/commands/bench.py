"""Benchmarks: ``pool`` (the pool's data and control planes); ttft, blocks and sessions come with the serving stack."""

from __future__ import annotations

import argparse
import json

from kvshare.units import parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="experiment", required=True)
    pool = sub.add_parser("pool", help="pool put/get bandwidth vs memcpy, lookup-and-lease latency")
    pool.add_argument("--pool", default=None, help="socket of a running pool (default: start one)")
    pool.add_argument("--pool-size", type=parse_size, default="1GiB", help="size of the pool this command starts")
    pool.add_argument("--page-size", type=parse_size, default="2MiB")
    pool.add_argument("--pages", type=int, default=128, help="pages per pass")
    pool.add_argument("--repeats", type=int, default=3)
    pool.add_argument("--lookup-ops", type=int, default=20000)
    pool.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    if args.experiment == "pool":
        return _run_pool(args)
    raise AssertionError(args.experiment)


def _run_pool(args: argparse.Namespace) -> int:
    import contextlib

    from kvshare.bench.pool_bench import PoolBenchConfig, run_pool_bench, summary_rows
    from kvshare.errors import UserError
    from kvshare.pool.spawn import running_pool

    if args.pool == "off":
        raise UserError("bench pool measures the pool: --pool off makes no sense here")
    pool_ctx = contextlib.nullcontext(args.pool) if args.pool else running_pool(args.pool_size, quiet=True)
    with pool_ctx as socket_path:
        try:
            cfg = PoolBenchConfig(socket_path=socket_path, page_bytes=args.page_size, num_pages=args.pages,
                                  repeats=args.repeats, lookup_ops=args.lookup_ops)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        result = run_pool_bench(cfg)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="kvshare bench pool")
        for col in ("measure", "figure", "against"):
            table.add_column(col)
        for row in summary_rows(result):
            table.add_row(*row)
        Console().print(table)
    return 0
