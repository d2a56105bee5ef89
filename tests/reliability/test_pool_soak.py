"""The pool soak: every kind of client at once against one ``kvshare pool``, counting pool exits and pages changed
under a lease (both must be 0).

For ``SOAK_S`` seconds (40 in the suite; ``KVSHARE_SOAK_LONG=1`` runs 600, ``KVSHARE_SOAK_S`` any number), beside a
``kvshare pool`` child of 16 MiB (64 pages of 256 KiB; eviction at commit above 0.97 and at every reserve short of
room) with a 10 s lease TTL (every client here holds a lease far shorter):

- 2 writers (test_fuzz_direct.writer_main): write, drop, re-write and flush chains twice the arena's size, so
  eviction never stops;
- 2 direct readers (test_fuzz_direct.reader_main): each page checked at lease and again at release; now and then
  they close their client as a timeout does and go on with a new one of the same holder;
- a link dropper (soak_roles): a thread shuts its socket down under its lookups; a new client of the same holder
  checks and ends what it held;
- a forker: forks while it holds a direct lease; the child's inherited client must refuse it, the child's own
  leases are checked, a third of the children are killed holding them; the parent's pages must not change;
- a vandal: garbage into its own hold table (flipped holds, counters and marks at 2**64 - 1, real generations in
  slot after slot under rewritten lease ids);
- killed clients: every 2 s a process takes two direct leases and is killed (SIGKILL).

The test watches the pool's process: an exit is counted and ends the run (its clients would fail or wait on a dead
socket). Afterwards: no hold left, every page out of view freed, the index and allocator agree, the pool's used bytes
are exactly its committed entries'.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import Counter

import pytest

from kvshare.pool import direct as direct_module
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import start_pool, stop_process
from tests.reliability import soak_roles
from tests.reliability.conftest import report
from tests.reliability.test_fuzz_direct import (
    ARENA_BYTES,
    NUM_CHAINS,
    assert_every_page_accounted_for,
    hold_until_killed,
    reader_main,
    write_chain,
    writer_main,
)

SOAK_S = float(os.environ.get("KVSHARE_SOAK_S") or (600 if os.environ.get("KVSHARE_SOAK_LONG") == "1" else 40))
SEED = 20261214
SPAWN = mp.get_context("spawn")
POOL_ARGS = ("--extent-size", "2MiB", "--high-watermark", "0.97", "--low-watermark", "0.9", "--hugepages", "off")
POOL_ARGS += ("--lease-ttl", "10")  # what the vandal's holds can keep out of view: a few pages for at most 10 s
VICTIM_EVERY_S = 2.0
VICTIM_WAIT_S = 15.0  # a spawned process imports numpy and kvshare first: seconds on a busy host

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.skipif(not direct_module.is_supported(), reason="no direct lookups here (x86-64 with membarrier)"),
]


class PoolProcess:
    """The ``kvshare pool`` child; ``has_exited`` counts its exit."""

    def __init__(self, path: str) -> None:
        self.path, self.exits = path, []
        self.proc = start_pool(path, ARENA_BYTES, POOL_ARGS, "WARNING")

    def has_exited(self) -> bool:
        if self.proc.poll() is not None and not self.exits:
            self.exits.append(self.proc.returncode)
        return bool(self.exits)

    def stop(self) -> None:
        stop_process(self.proc)


class Victims:
    """A process that takes two direct leases and is killed holding them (or after VICTIM_WAIT_S without); the next
    one starts VICTIM_EVERY_S after the last."""

    def __init__(self, path: str, seed: int) -> None:
        self.path, self.seed, self.counts = path, seed, Counter()
        self.victim, self.holding, self.started_at = None, None, 0.0

    def step(self, now: float) -> None:
        if self.victim is not None and (self.holding.is_set() or now - self.started_at > VICTIM_WAIT_S):
            self.counts["victims_killed_holding" if self.holding.is_set() else "victims_killed_early"] += 1
            self.victim.kill()
            self.victim.join()
            self.victim = None
            self.started_at = now
        if self.victim is None and now - self.started_at > VICTIM_EVERY_S:
            self.holding, self.started_at = SPAWN.Event(), now
            args = (self.path, self.seed + int(now * 1000), 2, self.holding)
            self.victim = SPAWN.Process(target=hold_until_killed, args=args, daemon=True)
            self.victim.start()

    def stop(self) -> None:
        if self.victim is not None:
            self.victim.kill()
            self.victim.join()


def soak(pool: PoolProcess, seed: int, duration_s: float) -> dict:
    """Run every client for ``duration_s`` while watching the pool; their counts summed, the first problems."""
    path = pool.path
    with PoolClient(path, name="soak-filler") as client:
        counter = 1
        for chain in range(NUM_CHAINS):
            counter = write_chain(client, chain, 0, counter)
    victims, retired, started = Victims(path, seed), [0], time.monotonic()
    with SPAWN.Pool(7) as procs:
        jobs = [procs.apply_async(reader_main, (path, r, seed * 100 + r, duration_s)) for r in range(2)]
        jobs += [procs.apply_async(soak_roles.link_dropper_main, (path, seed + 3, duration_s))]
        jobs += [procs.apply_async(soak_roles.forker_main, (path, seed + 4, duration_s))]
        counted = [procs.apply_async(writer_main, (path, w + 1, seed * 100 + 50 + w, duration_s)) for w in range(2)]
        counted += [procs.apply_async(soak_roles.vandal_main, (path, seed + 5, duration_s))]
        stats = {}
        with PoolClient(path, name="soak-stats") as watcher:
            while not all(job.ready() for job in jobs + counted) and not pool.has_exited():
                victims.step(time.monotonic())
                try:
                    stats = watcher.stats()
                    retired.append(stats["direct"]["retired_pages"])
                except Exception:  # a pool that died: counted by check()
                    pass
                time.sleep(0.05)
        victims.stop()
        if pool.has_exited():  # its clients fail or wait on a dead socket: the run ends here
            procs.terminate()
        totals, problems, failures = Counter(victims.counts), [], []
        for job in jobs + counted:
            if not job.ready():
                failures.append("did not finish")
                continue
            try:
                result = job.get(timeout=60)
            except Exception as exc:  # a client that failed: said in the figures, and the test fails
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            counts, first = result if isinstance(result, tuple) else (result, [])
            totals.update(counts)
            problems += first
    changed = sum(n for what, n in totals.items() if what.endswith(("_at_lease", "_at_release", "_after_link_drop")))
    return {
        **totals,
        "seconds": round(time.monotonic() - started, 1),
        "pool_exits": len(pool.exits),
        "pages_changed_under_lease": changed + totals["child_pages_changed"],
        "max_retired_pages": max(retired),
        "evictions": stats.get("evictions", 0),
        "pool_errors": stats.get("errors", 0),
        "client_failures": failures,
        "problems": problems,
    }


@pytest.mark.timeout(SOAK_S + 300)
def test_the_pool_survives_every_kind_of_client_at_once(tmp_path):
    """Fails when the pool exits, when any page changes under a lease (a reader's, a forked child's or its parent's,
    one held across a dropped link), when an inherited client serves a forked child, when a client fails, and when
    anything is left held or allocated afterwards."""
    pool = PoolProcess(str(tmp_path / "pool.sock"))
    try:
        figures = soak(pool, SEED, SOAK_S)
        changed = figures["pages_changed_under_lease"]
        print(f"SOAK pool_exits={figures['pool_exits']} pages_changed_under_lease={changed}")
        report("pool_soak", seed=SEED, **{k: v for k, v in figures.items() if k != "problems"})
        assert figures["pool_exits"] == 0, figures
        assert changed == 0, figures["problems"]
        assert not figures["client_failures"] and not figures.get("inherited_client_served"), figures
        assert figures["direct_leases"] >= 100 and figures["links_dropped"] > 0 and figures["children_ok"] > 0, figures
        assert figures["victims_killed_holding"] > 0 and figures["evictions"] > 0, figures
        # The pool's error count is reported, not asserted: a release whose reply a dropped link lost is sent again
        # by the new client, and the pool answers the second with an error (the lease is gone, as it should be).
        assert_every_page_accounted_for(pool.path)
    finally:
        pool.stop()
