"""Cost-aware promotion: the fits and the plan (pure), and pools that skip a slow store and use a fast one."""

import socket
import threading
import time

import pytest

from kvshare.pool.client import PoolClient, PoolRequestError
from kvshare.pool.metrics import PoolCollector
from kvshare.pool.remote.cost import REMEASURE_S, FetchFit, PrefillFit, PromotionCosts, fit_nonnegative, promote_len
from kvshare.pool.spawn import running_pool
from tests.pool.remote.conftest import NAMESPACE, MiB, make_keys, pool_args, remote_stats, wait_written, write_chain

pytestmark = pytest.mark.remote
PAGE = 1 * MiB


# -- pure ------------------------------------------------------------------------------------


def test_fits_recover_their_coefficients_and_stay_nonnegative():
    ns = [8, 32, 128, 512]
    assert fit_nonnegative([(n, n * n) for n in ns], [0.01 * n + 2e-5 * n * n for n in ns], 0) == pytest.approx(
        (0.01, 2e-5)
    )
    assert fit_nonnegative([(8, 64)], [0.4], 0) == pytest.approx((0.05, 0))  # one length: linear
    assert fit_nonnegative([(n, n * n) for n in ns], [1.0 - 0.001 * n for n in ns], 0)[1] == 0  # never negative
    latency, per_byte = fit_nonnegative([(1.0, x) for x in (1e6, 4e6)], [0.002 + x / 1e9 for x in (1e6, 4e6)], 1)
    assert (latency, 1 / per_byte) == pytest.approx((0.002, 1e9))


def test_the_plan_promotes_what_beats_recomputing():
    prefill = PrefillFit(a=0.01, b=0.0)  # 10 ms per chunk
    fast, slow = FetchFit(0.001, 1e9), FetchFit(0.001, 1e6)  # a 1 MiB page: 1 ms, or 1 s
    assert promote_len(prefill, fast, PAGE, 0, 64, timeout_s=5) == 64
    assert promote_len(prefill, slow, PAGE, 0, 64, timeout_s=5) == 0
    # only what arrives within the timeout is asked for: the part of the prefix that still beats recomputing
    assert promote_len(PrefillFit(a=2.0, b=0), slow, PAGE, 0, 64, timeout_s=5) == 4
    # attention: deep chunks cost more to recompute, so a long context can pay for a store a short one cannot
    quadratic = PrefillFit(a=1e-4, b=1e-4)
    store = FetchFit(0.0, 40 * PAGE)  # 25 ms a page
    assert (
        promote_len(quadratic, store, PAGE, 0, 16, 100) == 0 and promote_len(quadratic, store, PAGE, 256, 16, 100) == 16
    )


def test_without_a_rate_or_a_timing_everything_is_asked_for_and_a_stale_timing_is_renewed():
    costs = PromotionCosts()
    assert costs.plan(NAMESPACE, PAGE, 0, 8, 5.0, now=0).num_promote == 8  # no report: as without costs
    costs.report_prefill(NAMESPACE, PAGE, num_chunks=8, seconds=0.008)  # 1 ms a chunk
    plan = costs.plan(None, PAGE, 0, 8, 5.0, now=0)  # a chain of unknown namespace: that page size's reporter
    assert (plan.num_promote, plan.is_costed) == (8, False)  # the store was never timed: measure it
    costs.record_fetch(8 * PAGE, 0.8, now=1.0)  # 10 MB/s
    assert costs.plan(None, PAGE, 0, 8, 5.0, now=2.0).num_promote == 0
    assert costs.plan(None, PAGE + 1, 0, 8, 5.0, now=2.0).num_promote == 8  # another page size: no rate
    remeasure = costs.plan(None, PAGE, 0, 8, 5.0, now=1.0 + REMEASURE_S)
    assert remeasure.num_promote == 0 and remeasure.is_remeasure
    assert not costs.plan(None, PAGE, 0, 8, 5.0, now=2.0 + REMEASURE_S).is_remeasure  # one in REMEASURE_S
    assert costs.stats()["store_bytes_per_s"] == pytest.approx(8 * PAGE / 0.8, abs=1)
    assert costs.stats()["prefill_reports"] == 1


# -- pools against a slowed and a fast store ------------------------------------------------------


class SlowProxy:
    """A loopback TCP proxy in front of the store that passes its replies at about ``bytes_per_s``."""

    def __init__(self, upstream_port: int, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.rate), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, rate: float | None) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


def _promote_twice(writer: PoolClient, reader: PoolClient, prefix: str, num_pages: int = 4):
    """Chain X promoted (the store gets timed), then chain Y looked up; Y's lease, its seconds, the stats."""
    chains = [make_keys(f"{prefix}-{tag}", num_pages) for tag in "xy"]
    for i, keys in enumerate(chains):
        write_chain(writer, keys, PAGE, f"{prefix}-{i}")
    wait_written(writer, 2 * num_pages)
    first = reader.lookup(chains[0], PAGE)
    assert first.num_pages == num_pages  # no timing of the store yet: promoted, and now it is timed
    reader.release([first.lease_id], wait=True)
    start = time.perf_counter()
    second = reader.lookup(chains[1], PAGE)
    seconds = time.perf_counter() - start
    reader.release([second.lease_id], wait=True)
    reader.check_integrity()
    return second, seconds, remote_stats(reader)


def test_a_slowed_store_is_skipped_for_a_replica_that_recomputes_faster(redis_server, prefix):
    proxy = SlowProxy(redis_server.port, bytes_per_s=10e6)  # 4 MiB: ~0.4 s
    try:
        with (
            running_pool("64MiB", pool_args(redis_server.url, prefix), quiet=True) as a,
            running_pool("64MiB", pool_args(proxy.url, prefix), quiet=True) as b,
            PoolClient(a) as ca,
            PoolClient(b) as cb,
        ):
            assert cb.report_prefill(NAMESPACE, PAGE, num_chunks=4, seconds=0.02)  # 5 ms a chunk
            lease, seconds, stats = _promote_twice(ca, cb, prefix)
            assert lease.num_pages == 0, "answered as a miss at once"
            assert seconds < 0.2, f"the skipped lookup waited {seconds:.2f} s"
            assert stats["skipped_slower_lookups"] == 1 and stats["skipped_slower_chunks"] == 4
            assert stats["cost_checked_lookups"] == 1 and stats["promoted_pages"] == 4 and stats["lookups"] == 1
            assert 0 < stats["store_bytes_per_s"] < 20e6 and stats["prefill_reports"] == 1
            names = {m.name for m in PoolCollector(cb.stats).collect()}
            assert {
                "kvshare_pool_remote_skipped_slower_lookups",
                "kvshare_pool_remote_promoted_pages",
                "kvshare_pool_remote_store_bytes_per_s",
            } <= names
    finally:
        proxy.close()


def test_a_fast_store_is_used_for_a_replica_that_recomputes_slower(redis_server, prefix):
    with (
        running_pool("64MiB", pool_args(redis_server.url, prefix), quiet=True) as a,
        running_pool("64MiB", pool_args(redis_server.url, prefix), quiet=True) as b,
        PoolClient(a) as ca,
        PoolClient(b) as cb,
    ):
        assert cb.report_prefill(NAMESPACE, PAGE, num_chunks=4, seconds=20.0)
        lease, _, stats = _promote_twice(ca, cb, prefix)
        assert lease.num_pages == 4
        assert stats["cost_checked_lookups"] == 1 and stats["skipped_slower_lookups"] == 0
        assert stats["promoted_pages"] == 8 and stats["store_bytes_per_s"] > 0


def test_a_report_to_a_pool_without_a_remote_tier_is_taken_and_ignored():
    with running_pool("16MiB", (), quiet=True) as a, PoolClient(a) as ca:
        assert ca.report_prefill(NAMESPACE, PAGE, num_chunks=4, seconds=1.0) is False
        with pytest.raises(PoolRequestError, match="bad_report"):
            ca.report_prefill(b"short", PAGE, num_chunks=4, seconds=1.0)
