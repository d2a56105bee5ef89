"""What the router's loop spends reading a token-id prompt to place it, per policy and prompt length.

    PYTHONPATH=$PWD python benchmarks/route_facts_cost.py [--lengths 8192,32768,131072] [--repeats 20]

Per policy: the body decoded for the facts the policy reads (kvshare.router.facts.route_facts) and, for
pool_aware, its ranking of two replicas (PoolAwarePlacer.order: the prompt's chain of chunk hashes, the pool's
index, the sent memory) on an index that holds nothing. Median over --repeats, in ms, on the router's one thread:
every request waits for this before it is sent.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvshare.router.cost_model import CostModel
from kvshare.router.facts import route_facts
from kvshare.router.kv_event_feed import KVEventFeed
from kvshare.router.pool_aware import PoolAwarePlacer


def placer() -> PoolAwarePlacer:
    feed = KVEventFeed("ipc:///unused", "kv@")  # never started: an empty index that counts as live
    feed.last_seq = 0
    return PoolAwarePlacer(2, CostModel(), feed)


def median_ms(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="8192,32768,131072")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    print("| prompt tokens | cache_aware facts ms | pool_aware facts ms | pool_aware ranking ms |")
    print("| ---: | ---: | ---: | ---: |")
    for n in (int(x) for x in args.lengths.split(",")):
        rng = random.Random(n)
        ids = [rng.randrange(150_000) for _ in range(n)]
        body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 16, "stream": True}).encode()
        aware = placer()
        facts = route_facts("pool_aware", body, None, lambda salt: "", aware)
        cells = [
            median_ms(lambda: route_facts("cache_aware", body, None, lambda salt: ""), args.repeats),
            median_ms(lambda: route_facts("pool_aware", body, None, lambda salt: "", aware), args.repeats),
            median_ms(lambda: aware.order(facts.prompt_ids, None, [0, 0], [True, True], 0, time.monotonic()), 20),
        ]
        print(f"| {n} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
