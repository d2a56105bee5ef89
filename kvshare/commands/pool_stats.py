"""Print a running pool's stats as JSON: capacity, pages, entries (``checkpoints``: a hybrid model's state checkpoints
among them, and their bytes), leases, evictions, hits, errors."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        "--pool",
        dest="socket",
        default=None,
        help="the pool's Unix socket (default: kvshare's default socket, else the pool of a running kvshare up)",
    )
    p.add_argument("--name", default=None, help="the pool of `kvshare up --name NAME` (its port when not named)")


def run(args: argparse.Namespace) -> int:
    from kvshare.errors import UserError
    from kvshare.paths import find_pool_socket
    from kvshare.pool.client import PoolClient, PoolUnavailable

    try:
        with PoolClient(args.socket or find_pool_socket(args.name), name="pool-stats") as client:
            print(json.dumps(client.stats(), indent=2, sort_keys=True))
    except PoolUnavailable as exc:
        raise UserError(str(exc)) from None
    return 0
