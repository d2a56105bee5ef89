"""Administer a running pool: flush chunks (all, or one namespace) and list leases with their ages."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", "--pool", dest="socket", default=None, help="the pool's Unix socket")
    sub = p.add_subparsers(dest="action", required=True)
    flush = sub.add_parser("flush", help="drop committed chunks")
    flush.add_argument("--namespace", default=None, help="hex namespace digest; all chunks when omitted")
    sub.add_parser("leases", help="list leases with their ages")


def run(args: argparse.Namespace) -> int:
    from kvshare.errors import UserError
    from kvshare.paths import default_pool_socket
    from kvshare.pool.client import PoolClient, PoolUnavailable

    try:
        with PoolClient(args.socket or default_pool_socket(), name="pool-admin") as client:
            if args.action == "flush":
                namespace = bytes.fromhex(args.namespace) if args.namespace else None
                print(json.dumps({"dropped": client.flush(namespace)}))
            else:
                leases = [
                    {"lease_id": l.lease_id, "client_id": l.client_id, "client": l.client_name,
                     "pages": l.num_pages, "age_s": l.age_s}
                    for l in client.list_leases()
                ]
                print(json.dumps(leases, indent=2))
    except (PoolUnavailable, ValueError) as exc:
        raise UserError(str(exc)) from None
    return 0
