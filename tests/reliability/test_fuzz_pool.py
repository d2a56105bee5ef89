"""Fuzzing the pool daemon with random sequences of well-formed operations from several clients.

tests/pool/test_bad_input.py fuzzes malformed frames; this drives reservations, commits, aborts, lookups,
releases, drops, flushes and namespace listings (valid and invalid ids, sizes and keys) against a daemon
with a namespace quota, closing clients at random with work open. After each sequence: the daemon is up,
no lease or reservation outlives its client, its index and allocator agree, and no namespace is over quota.
"""

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvshare.pool.client import PoolClient, PoolRequestError
from kvshare.pool.spawn import running_pool
from tests.pool.conftest import make_keys

pytestmark = pytest.mark.reliability
MiB = 1 << 20
QUOTA = 6 * MiB
NAMESPACES = [bytes([65 + i]) * 16 for i in range(3)]

reserves = st.tuples(
    st.just("reserve"),
    st.integers(0, 2),
    st.integers(0, 2),
    st.integers(0, 15),
    st.integers(1, 6),
    st.sampled_from([MiB, MiB, MiB, 2 * MiB, 3, 1 << 40]),
)
commits = st.tuples(st.just("commit"), st.integers(0, 2), st.integers(-1, 8))
ops = st.lists(
    st.one_of(
        reserves,
        reserves,
        commits,
        commits,
        st.tuples(st.just("abort"), st.integers(0, 2), st.integers(-1, 8)),
        st.tuples(st.just("lookup"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 15), st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 2), st.integers(-1, 8)),
        st.tuples(st.just("drop"), st.integers(0, 2), st.integers(0, 15)),
        st.tuples(st.just("flush"), st.integers(0, 2), st.integers(-1, 2)),
        st.tuples(st.just("namespaces"), st.integers(0, 2)),
        st.tuples(st.just("close"), st.integers(0, 2)),
    ),
    min_size=10,
    max_size=60,
)


@pytest.fixture(scope="module")
def pool():
    with running_pool("32MiB", ("--extent-size", "8MiB", "--namespace-quota", "6MiB"), quiet=True) as path:
        yield path


EXAMPLE = [0]  # a fresh key space per example: the module's pool outlives examples


def chain(ns: int, tag: int, n: int = 6) -> list[bytes]:
    return make_keys(f"fuzz-{EXAMPLE[0]}-{ns}-{tag}", n)


def run_op(clients: dict, path: str, op: tuple, opened: list) -> None:
    """One operation; ``opened`` holds (client, reservation id, pages) of reservations not finished yet."""
    kind, c = op[0], op[1]
    if kind == "close":
        if c in clients:
            clients.pop(c).close()  # whatever it holds must be released by the daemon
            opened[:] = [r for r in opened if r[0] != c]
        return
    owner = None
    if kind in ("commit", "abort") and opened and op[2] >= 0:  # mostly: finish an open reservation...
        owner, rid, n = opened.pop(op[2] % len(opened))
        c = owner if op[2] % 4 else (owner + 1) % 3  # ... now and then as a client that does not own it
    else:
        rid, n = abs(op[2]) + 10_000 if kind in ("commit", "abort", "release") else 0, 1
    if c not in clients:
        clients[c] = PoolClient(path, name=f"fuzz{c}").connect()
    client = clients[c]
    try:
        if kind == "reserve":
            _, _, ns, tag, n, page = op
            res = client.reserve(NAMESPACES[ns], chain(ns, tag)[:n], page)
            if res.reservation_id:
                opened.append((c, res.reservation_id, len(res.grants)))
        elif kind == "commit":
            client.commit(rid, [0] * n)
        elif kind == "abort":
            client.abort(rid)
        elif kind == "lookup":
            _, _, ns, tag, lease = op
            found = client.lookup(chain(ns, tag), MiB, lease=lease)
            if found.lease_id and tag % 2:  # half of the leases are released, the others left to the close
                client.release([found.lease_id], wait=True)
        elif kind == "release":
            client.release([rid], wait=True)
        elif kind == "drop":
            client.drop(chain(op[2] % 3, op[2])[:3])
        elif kind == "flush":
            client.flush(NAMESPACES[op[2]] if op[2] >= 0 else None)
        else:
            assert client.list_namespaces().quota_bytes == QUOTA
        event(f"{kind} done")
    except PoolRequestError as exc:  # refusals are fine (unknown ids, bad sizes); the daemon must stay consistent
        event(f"{kind} refused: {exc.code}")
        assert exc.code in ("unknown_reservation", "unknown_lease", "bad_page_size", "not_owner", "duplicate_keys"), exc
        if exc.code == "not_owner" and kind in ("commit", "abort"):  # the owner still holds it
            opened.append((owner, rid, n))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=ops)
def test_random_operation_sequences_keep_the_daemon_consistent(pool, sequence):
    clients: dict = {}
    opened: list = []
    EXAMPLE[0] += 1
    try:
        for op in sequence:
            run_op(clients, pool, op, opened)
    finally:
        for client in clients.values():
            client.close()
    with PoolClient(pool, name="checker") as checker:
        checker.check_integrity()
        for row in checker.list_namespaces().namespaces:
            assert row.num_bytes <= QUOTA, row
        import time

        deadline = time.monotonic() + 10
        while (stats := checker.stats())["leases"] or stats["reservations"]:  # the closes are seen in order
            assert time.monotonic() < deadline, stats
            time.sleep(0.02)
