"""The clients of the pool soak (test_pool_soak.py), each run in a process of its own (spawned: importable).

Each returns a Counter of what it did and, for the readers, the first problems it saw: a page whose bytes changed
under a lease ("changed", "foreign", "torn": the checks of test_fuzz_direct.check_page, at lease and again at
release). The writers are test_fuzz_direct.writer_main: they write, drop, re-write and flush chains in an arena half
their size, so reserves and commits evict all the time.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import threading
import time
from collections import Counter

from kvshare.pool.client import PoolClient, PoolUnavailable
from kvshare.pool.direct import GEN, SLOT_BYTES
from kvshare.pool.direct_reader import DIRECT_LEASE_BIT
from kvshare.pool.hold_tables import CLOSED, HOLDS_AT_WORD, HWM, LOOKUPS, TOUCH_RING, TOUCHES
from tests.reliability.test_fuzz_direct import CHAIN_LEN, NUM_CHAINS, PAGE_SIZES, chain_keys, check_page

MAX_PROBLEMS = 8
# A lease is held at most this long (far below the soak pool's lease TTL): a page may leave a lease past its TTL,
# which the checks would count as changed under it.
HOLD_AT_MOST_S = 0.05


class Checks:
    """Counts of page checks and what they found; the first few problems in words."""

    def __init__(self) -> None:
        self.counts, self.problems = Counter(), []

    def page(self, client: PoolClient, header, key: bytes, when: str) -> None:
        problem, stamp = check_page(client.page(header.offset, header.page_bytes), header, key)
        self.counts["pages_verified"] += 1
        if problem is not None:
            self.counts[f"{problem}_{when}"] += 1
            if len(self.problems) < MAX_PROBLEMS:
                self.problems.append(f"{problem} {when}: key {key.hex()} at {header.offset} stamp {stamp:#x}")

    def lease(self, client: PoolClient, grant, keys: list[bytes], when: str) -> None:
        for key, header in zip(keys, grant.pages):
            self.page(client, header, key, when)


def random_chain(rng: random.Random) -> tuple[list[bytes], int]:
    chain = rng.randrange(NUM_CHAINS)
    return chain_keys(chain)[: rng.randint(1, CHAIN_LEN)], PAGE_SIZES[chain % len(PAGE_SIZES)]


def drop_link_now_and_then(client_of, rng: random.Random, stop: threading.Event) -> None:
    """Shut the socket of the current client down at random moments, lookups under way or not (a link that drops)."""
    while not stop.wait(rng.uniform(0.005, 0.08)):
        sock = client_of()._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def link_dropper_main(path: str, seed: int, duration_s: float) -> tuple[Counter, list[str]]:
    """Lease chains directly while another thread drops the link under the lookups; after each drop a new client
    of the same holder (the process lives: its holds stay) checks and releases what was held, as a PoolLink does."""
    rng, checks, holder = random.Random(seed), Checks(), os.urandom(16)
    current = [PoolClient(path, name="soak-dropper", holder=holder, direct=True).connect()]
    stop = threading.Event()
    dropper = threading.Thread(target=drop_link_now_and_then, args=(lambda: current[0], random.Random(~seed), stop))
    dropper.start()
    held, taken_at = [], []  # (grant, keys) of the leases held, oldest first; when each was taken
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        client = current[0]
        keys, page_bytes = random_chain(rng)
        try:
            grant = client.lookup(keys, page_bytes)
            if len(held) > 3 or (held and time.monotonic() - taken_at[0] > HOLD_AT_MOST_S):
                checks.lease(client, *held[0], "at_release")
                client.release([held[0][0].lease_id], wait=True)
                held.pop(0)
                taken_at.pop(0)
        except PoolUnavailable:  # the link dropped: the same holder, connected again, ends what it held
            checks.counts["links_dropped"] += 1
            current[0] = end_held(client, path, holder, held, checks, "after_link_drop")
            held, taken_at = [], []
            continue
        if grant.lease_id:
            checks.counts["direct_leases" if grant.lease_id & DIRECT_LEASE_BIT else "round_trip_leases"] += 1
            checks.lease(client, grant, keys, "at_lease")
            held.append((grant, keys))
            taken_at.append(time.monotonic())
    stop.set()
    dropper.join()
    end_held(current[0], path, holder, held, checks, "at_release").close()
    return checks.counts, checks.problems


def end_held(client: PoolClient, path: str, holder: bytes, held: list, checks: Checks, when: str) -> PoolClient:
    """Check the pages of every lease held (the bytes committed, still), then end the leases through a new client of
    the same holder (a direct lease through the hold table it shares, the pool's by id); returns the new client."""
    for grant, keys in held:
        checks.lease(client, grant, keys, when)
    client.close(end_holds=False)
    again = PoolClient(path, name="soak-dropper", holder=holder, direct=True).connect()
    again.release([grant.lease_id for grant, _keys in held])  # fire and forget: a forgotten holder's are gone
    return again


def forker_main(path: str, seed: int, duration_s: float) -> tuple[Counter, list[str]]:
    """Hold a direct lease, fork: the child finds the inherited client refused, leases through a client of its own
    and checks the pages (now and then it is killed holding them); the parent's pages must not change meanwhile."""
    rng, checks = random.Random(seed), Checks()
    client = PoolClient(path, name="soak-forker", direct=True).connect()
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        keys, page_bytes = random_chain(rng)
        grant = client.lookup(keys, page_bytes)
        if not grant.lease_id & DIRECT_LEASE_BIT:
            client.release([grant.lease_id])
            time.sleep(0.005)
            continue
        checks.lease(client, grant, keys, "at_lease")
        child_keys, child_page_bytes = random_chain(rng)
        pid = os.fork()
        if pid == 0:
            os._exit(forked_child(client, path, child_keys, child_page_bytes))
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0, 0.02))
            os.kill(pid, signal.SIGKILL)
            checks.counts["children_killed"] += 1
        _pid, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):
            checks.counts[
                {0: "children_ok", 1: "inherited_client_served", 2: "child_pages_changed"}.get(
                    os.WEXITSTATUS(status), "children_failed"
                )
            ] += 1
        checks.lease(client, grant, keys, "at_release")
        client.release([grant.lease_id])
    client.close()
    return checks.counts, checks.problems


def forked_child(parent: PoolClient, path: str, keys: list[bytes], page_bytes: int) -> int:
    """The child's run (its exit code): 1 when the inherited client served it, 2 when a page changed under its own
    lease, 3 on any other error, else 0."""
    try:
        try:
            parent.lookup(keys, page_bytes)
            return 1
        except PoolUnavailable:
            pass
        checks = Checks()
        with PoolClient(path, name="soak-forked", direct=True) as own:
            grant = own.lookup(keys, page_bytes)
            checks.lease(own, grant, keys, "at_lease")
            time.sleep(0.005)
            checks.lease(own, grant, keys, "at_release")
            own.release([grant.lease_id])
        return 2 if checks.problems else 0
    except BaseException:
        return 3


def vandal_main(path: str, seed: int, duration_s: float) -> Counter:
    """Write garbage into its own hold table for ``duration_s``: a hold flipped as fast as it goes (a thread), marks
    and counters at 2**64 - 1, a ring of nonsense, CLOSED cleared and set, and holds that name real generations (read
    from the directory) in slot after slot under lease ids rewritten again and again."""
    rng, counts = random.Random(seed), Counter()
    client = PoolClient(path, name="soak-vandal", direct=True).connect()
    table, directory, num_slots = client._direct._table, client._direct._dir, client.hello.direct_slots
    word = struct.Struct("<Q")
    deadline = time.monotonic() + duration_s
    flipper = threading.Thread(target=flip_hold, args=(table, deadline))
    flipper.start()
    while time.monotonic() < deadline:
        act = rng.randrange(5)
        if act == 0:
            word.pack_into(table, HWM * 8, 1)  # the flipped hold is the only one: the pool's column is one word
        elif act == 1:
            for index in (HWM, LOOKUPS, LOOKUPS + 1, TOUCHES, LOOKUPS + 3):
                word.pack_into(table, index * 8, rng.choice((2**64 - 1, 2**63, rng.getrandbits(64))))
        elif act == 2:
            table[8 * 8 : (8 + TOUCH_RING) * 8] = rng.randbytes(TOUCH_RING * 8)
            word.pack_into(table, CLOSED * 8, rng.getrandbits(1))
        else:  # pin a few real pages, moving and relabelling the holds
            word.pack_into(table, HWM * 8, 64)
            for _ in range(8):
                gen = word.unpack_from(directory, rng.randrange(num_slots) * SLOT_BYTES + GEN * 8)[0]
                struct.pack_into("<QQ", table, (HOLDS_AT_WORD + 2 * rng.randrange(64)) * 8, gen, rng.getrandbits(64))
        counts[f"vandal_act{act}"] += 1
        time.sleep(0.01)
    flipper.join()
    client.close()
    return counts


def flip_hold(table, deadline: float) -> None:
    """Set and clear the table's first hold as fast as Python goes, until ``deadline``."""
    word, at = struct.Struct("<Q"), HOLDS_AT_WORD * 8
    while time.monotonic() < deadline:
        for _ in range(10000):
            word.pack_into(table, at, 7)
            word.pack_into(table, at, 0)
