"""Lookup-and-lease + release of one client against a pool, with the cores quiet and with busy neighbours.

Starts a pool, commits a chain of keys, then alternates phases: quiet (nothing else of ours runs) and contended
(``--burners`` processes spinning ``while 1: pass``, as a replica's tokenizer and scheduler beside the pool on a
small host). Each phase runs lookup-and-lease + release back to back for ``--seconds`` and prints the rate, p50,
p99 and the CPU pressure of the phase (PSI "some": the share of the phase in which some runnable task waited for
a core, from /proc/pressure/cpu's total; near 0 on a quiet machine, near 100 with the burners). Alternating phases
keeps a drift of the machine's other load out of the quiet-vs-contended comparison; run it on a quiet machine for
absolute figures: a "quiet" phase whose PSI is high says the machine was not.

    PYTHONPATH=$PWD python benchmarks/pool_contention.py --rounds 3 --seconds 4 --burners 2

Goal (2-core host, two burners): >= 20k/s with p99 <= 200 us, and the quiet phase as fast as without burners.
``--paths`` names the clients measured in each phase: ``round_trip`` (a lookup over the socket) and ``direct`` (the
pool's directory, no round trip: kvshare/pool/direct.py).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import subprocess
import sys
import time

from kvshare.bench.pool_bench import lookup_round_trips
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool

NAMESPACE = hashlib.blake2b(b"kvshare-bench-contention", digest_size=16).digest()
PAGE_BYTES = 4096


def start_burners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]


def stop_burners(burners: list[subprocess.Popen]) -> None:
    for proc in burners:
        proc.kill()
    for proc in burners:
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="quiet + contended pairs")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    parser.add_argument("--burners", type=int, default=2, help="busy processes in a contended phase")
    parser.add_argument("--keys", type=int, default=8, help="keys per lookup (all committed)")
    parser.add_argument("--pool-arg", action="append", default=[], help="an extra `kvshare pool` argument")
    parser.add_argument(
        "--paths",
        default="round_trip,direct",
        help="comma-separated: round_trip (every lookup over the socket), direct (a client that leases fully "
        "committed chains from the pool's directory, no round trip); each phase measures each path",
    )
    parser.add_argument("--json", action="store_true", help="one JSON line per phase instead of a table")
    args = parser.parse_args()

    keys = [hashlib.blake2b(f"contention/{i}".encode(), digest_size=16).digest() for i in range(args.keys)]
    with running_pool("64MiB", tuple(args.pool_arg), quiet=True) as socket_path:
        paths = args.paths.split(",")
        clients = {path: PoolClient(socket_path, name=f"bench-{path}", direct=path == "direct") for path in paths}
        with contextlib.ExitStack() as stack:
            for client in clients.values():
                stack.enter_context(client)
            if "direct" in clients and not clients["direct"].is_direct:
                sys.exit("this machine offers no direct lookups (x86-64 Linux with membarrier only)")
            writer = next(iter(clients.values()))
            reservation = writer.reserve(NAMESPACE, keys, PAGE_BYTES)
            writer.commit(reservation.reservation_id, [0] * len(reservation.grants))
            for client in clients.values():
                lookup_round_trips(client, keys, PAGE_BYTES, seconds=0.5)  # warm up
            if not args.json:
                print(f"{'phase':<12} {'path':<11} {'ops/s':>9} {'p50 us':>8} {'p99 us':>8} {'PSI some %':>11}")
            for round_no in range(args.rounds):
                for (phase, num_burners), path in itertools.product((("quiet", 0), ("contended", args.burners)), paths):
                    burners = start_burners(num_burners)
                    try:
                        if burners:
                            time.sleep(0.3)  # let the burners take their cores
                        figures = lookup_round_trips(clients[path], keys, PAGE_BYTES, seconds=args.seconds)
                    finally:
                        stop_burners(burners)
                    if args.json:
                        print(
                            json.dumps(
                                {
                                    "round": round_no,
                                    "phase": phase,
                                    "path": path,
                                    "burners": num_burners,
                                    **{k: v if v is None else round(v, 1) for k, v in figures.items()},
                                }
                            ),
                            flush=True,
                        )
                    else:
                        waited = figures["cpu_waited_pct"]
                        psi = "n/a" if waited is None else f"{waited:.1f}"
                        print(
                            f"{phase:<12} {path:<11} {figures['lookup_ops_per_s']:>9,.0f} "
                            f"{figures['lookup_p50_us']:>8.1f} {figures['lookup_p99_us']:>8.1f} {psi:>11}",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
