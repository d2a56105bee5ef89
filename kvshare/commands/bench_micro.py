"""`kvshare bench pool` and `kvshare bench parse`: the microbenchmarks of one part each, the pool's data and
control planes (kvshare.bench.pool_bench) and a replica's read of a token-id prompt (kvshare.bench.parse_bench)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from kvshare.units import parse_size


def add_micro_arguments(sub, parse_tokens: Callable[[str], tuple[int, ...]]) -> None:
    """The ``pool`` and ``parse`` subcommands of ``kvshare bench`` (``sub``: its subparsers)."""
    pool = sub.add_parser("pool", help="pool put/get bandwidth vs memcpy, lookup-and-lease latency")
    pool.add_argument("--pool", default=None, help="socket of a running pool (default: start one)")
    pool.add_argument("--pool-size", type=parse_size, default="1GiB", help="size of the pool this command starts")
    pool.add_argument("--page-size", type=parse_size, default="2MiB", help="bytes per page stored and read")
    pool.add_argument("--pages", type=int, default=128, help="pages per pass")
    pool.add_argument("--repeats", type=int, default=3, help="timed passes of each measure")
    pool.add_argument("--lookup-ops", type=int, default=20000, help="lookup-and-lease + release operations timed")
    pool.add_argument("--json", action="store_true", help="print the figures as JSON")
    parse = sub.add_parser("parse", help="a replica's read of a token-id prompt by thread count, vs a typed decode")
    parse.add_argument(
        "--lengths",
        type=parse_tokens,
        default=(32768, 131072, 262144),
        help="prompt lengths in tokens, e.g. 32768,128k",
    )
    parse.add_argument("--repeats", type=int, default=20, help="best of this many reads")
    parse.add_argument("--json", action="store_true", help="print one JSON line per length")


def run_pool(args: argparse.Namespace) -> int:
    import contextlib

    from kvshare.bench.pool_bench import PoolBenchConfig, run_pool_bench, summary_rows
    from kvshare.errors import UserError
    from kvshare.pool.spawn import running_pool

    if args.pool == "off":
        raise UserError("bench pool measures the pool: --pool off makes no sense here")
    pool_ctx = contextlib.nullcontext(args.pool) if args.pool else running_pool(args.pool_size, quiet=True)
    with pool_ctx as socket_path:
        try:
            cfg = PoolBenchConfig(
                socket_path=socket_path,
                page_bytes=args.page_size,
                num_pages=args.pages,
                repeats=args.repeats,
                lookup_ops=args.lookup_ops,
            )
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


def run_parse(args: argparse.Namespace) -> int:
    from kvshare.bench.parse_bench import ParseBenchConfig, run_parse_bench
    from kvshare.errors import UserError

    try:
        cfg = ParseBenchConfig(lengths=tuple(args.lengths), repeats=args.repeats)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    rows = run_parse_bench(cfg)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    from rich.console import Console
    from rich.table import Table

    threads = list(rows[0]["ms_by_threads"])
    table = Table(title=f"kvshare bench parse (ms, best of {cfg.repeats})")
    for col in ("tokens", "body MB", *(f"{k} thread{'s' if k > 1 else ''}" for k in threads), "typed list[int]"):
        table.add_column(col, justify="right")
    for row in rows:
        by_threads = (f"{row['ms_by_threads'][k]:.2f}" for k in threads)
        table.add_row(str(row["tokens"]), f"{row['body_bytes'] / 1e6:.2f}", *by_threads, f"{row['typed_list_ms']:.2f}")
    Console().print(table)
    return 0
