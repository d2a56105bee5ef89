"""Faults under load, each injected into a running `kvshare up` cluster of the tiny model.

- a replica killed with SIGKILL mid-stream: the router and the other replica keep serving; the pool
  drops the dead client's leases and reservations;
- the pool daemon killed with SIGKILL: replicas serve cold, reconnect when it is restarted on the same
  socket, and never answer wrongly;
- a pool far too small for the load: eviction keeps working, leased pages are never evicted, no request fails;
- clients that leave mid-stream or stop reading: the replica frees the request.

Every load run compares sampled answers with pool-off references (kvshare.reliability.load).
"""

import json
import os
import signal
import socket
import time
import urllib.parse

import numpy as np
import pytest

from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import start_pool
from tests.pool.conftest import make_keys
from tests.reliability.conftest import (
    BackgroundLoad,
    cold,
    completion,
    health,
    load_figures,
    metric,
    pool_is_clean,
    report,
    start,
    wait_until,
)

pytestmark = pytest.mark.reliability
PAGE = 2 << 20  # one 256-token chunk of the tiny model (8 layers x K,V x 2 heads x 64 x float32)


def open_stream(url: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """A raw streaming POST (so the test decides when, and whether, to read)."""
    parts = urllib.parse.urlsplit(url)
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: a small window
    sock.settimeout(60)
    sock.connect((parts.hostname, parts.port))
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {body.pop('_path', '/v1/completions')} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def long_stream(max_tokens: int = 3000) -> dict:
    return {
        "model": "tiny",
        "prompt": "tell me everything",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 5,
    }


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(4096)
        assert chunk, f"the connection closed before {marker!r}: {data[-500:]!r}"
        data += chunk
    return data


def read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def test_replica_killed_mid_stream_router_and_other_replica_keep_serving_pool_keeps_nothing_stale():
    cluster = start("round_robin")
    try:
        victim_url = cluster.replica_urls[0]
        load = BackgroundLoad(
            cluster.router_url, num_sessions=6, duration_s=25, check_share=0.3, max_tokens=6, request_timeout_s=60
        )
        time.sleep(6)
        stream = open_stream(victim_url, long_stream())
        read_until(stream, b"data:")  # the stream is under way
        with PoolClient(cluster.pool_socket, name="test") as pool:
            clients_before = pool.stats()["clients"]
        served_before = metric(cluster.replica_urls[1], "kvshare_request_success_total")
        os.kill(cluster.processes["replica0"].pid, signal.SIGKILL)
        cluster.processes["replica0"].wait(30)
        assert b"data: [DONE]" not in read_all(stream)  # the stream broke off
        summary = load.result()
        assert summary["mismatches"] == 0 and summary["unfinished"] == 0 and summary["rate_limited"] == 0
        # at most the requests under way at replica0 when it died (one per session) broke off mid-stream;
        # everything else, including requests routed to it after its death, was served
        assert summary["errors"] <= 6 and set(summary["errors_by_kind"]) <= {"HTTP 200"}, summary["errors_by_kind"]
        assert summary["ok"] >= 30
        assert metric(cluster.replica_urls[1], "kvshare_request_success_total") > served_before + 10
        status, out = completion(cluster.router_url, "after the crash")
        assert status == 200 and out["kvshare"]["replica"] == "replica1"
        assert [r["healthy"] for r in health(cluster.router_url)["replicas"]] == [False, True]
        stats = pool_is_clean(cluster.pool_socket)  # the dead replica's leases and reservations are gone
        assert stats["clients"] <= clients_before - 1
        report(
            "kill -9 replica",
            **load_figures(summary),
            errors_by_kind=summary["errors_by_kind"],
            pool_leases=stats["leases"],
            pool_reservations=stats["reservations"],
            pool_disconnects=stats["disconnects"],
        )
    finally:
        cluster.stop()


def test_pool_killed_replicas_serve_cold_and_reconnect_after_restart_on_the_same_socket():
    cluster = start("alternate", pool_size="256MiB")
    sock_path = cluster.pool_socket
    try:
        load = BackgroundLoad(
            cluster.router_url, num_sessions=4, duration_s=30, check_share=0.5, max_tokens=6, request_timeout_s=60
        )
        time.sleep(6)
        os.kill(cluster.processes["pool"].pid, signal.SIGKILL)
        cluster.processes["pool"].wait(30)
        prompt = "while the pool is down " * 40  # ~900 tokens: 3 full chunks
        for url in cluster.replica_urls:  # both replicas answer, cold, and right
            status, out = completion(url, prompt, max_tokens=6, kvshare={"use_local_cache": False})
            assert status == 200 and out["kvshare"]["pool_tokens"] == 0
            assert out["choices"][0]["token_ids"] == cold(url, prompt)
        time.sleep(4)
        cluster.processes["pool"] = start_pool(sock_path, "256MiB", log_level="WARNING")  # same socket path

        def reused_across_replicas():
            text = f"after the restart {time.monotonic()} " * 30
            first = completion(cluster.replica_urls[0], text)[1]
            status, out = completion(cluster.replica_urls[1], text)
            assert status == 200 and out["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
            return out["kvshare"]["pool_tokens"] > 0 and out

        # the first answer was computed (a new prompt); the second, loaded from the new pool, must equal it
        wait_until(reused_across_replicas, 90, "both replicas to use the restarted pool", interval_s=1.0)
        summary = load.result()
        assert summary["errors"] == 0 and summary["mismatches"] == 0 and summary["unfinished"] == 0, summary["details"]
        assert summary["checked"] >= 5
        stats = pool_is_clean(sock_path)
        report("kill -9 pool", **load_figures(summary), new_pool_hits=stats["hit_chunks"])
    finally:
        cluster.stop()


def test_pool_full_under_load_evicts_but_never_leased_pages_and_no_request_fails():
    # 12 pages of 2 MiB for 4 sessions whose conversations reach 2048 tokens (8 chunks each)
    cluster = start("alternate", pool_size="24MiB")
    try:
        namespace = b"pinned-by-test!!"
        with PoolClient(cluster.pool_socket, name="pinner") as pool:
            keys = make_keys("pinned", 4)
            res = pool.reserve(namespace, keys, PAGE)
            assert len(res.grants) == 4
            sums = []
            for i, offset in res.grants:
                page = pool.page(offset, PAGE)
                page[:] = np.random.default_rng(i).integers(0, 255, PAGE, dtype=np.uint8)
                sums.append(page_checksum(page))
            pool.commit(res.reservation_id, sums)
            lease = pool.lookup(keys[:2], PAGE)  # pin two; the other two are fair game
            assert lease.num_pages == 2
            load = BackgroundLoad(
                cluster.router_url, num_sessions=4, duration_s=25, check_share=0.3, max_tokens=6, request_timeout_s=60
            )
            summary = load.result()
            stats = pool.stats()
            assert stats["evictions"] > 0  # the pool was full, and eviction kept making room
            assert [page_checksum(pool.page(h.offset, PAGE)) for h in lease.pages] == sums[:2]  # untouched
            for key in keys[2:]:  # the unpinned ones, written with them, were evicted
                assert pool.lookup([key], PAGE, lease=False).num_pages == 0
            pool.release([lease.lease_id], wait=True)
        assert summary["errors"] == 0 and summary["mismatches"] == 0 and summary["unfinished"] == 0
        assert summary["ok"] >= 20 and summary["checked"] >= 3
        for url in cluster.replica_urls:  # every page loaded matched its checksum: none was reused under a reader
            assert metric(url, "kvshare_pool_checksum_failures_total") == 0
        pool_is_clean(cluster.pool_socket)
        report(
            "pool full",
            **load_figures(summary),
            evictions=stats["evictions"],
            skipped_stores=stats["skipped_stores"],
            pinned_pages_intact=2,
        )
    finally:
        cluster.stop()


def test_clients_that_leave_or_stop_reading_free_the_request():
    cluster = start("round_robin", replica_args=("--write-timeout", "2"), router_args=("--write-timeout", "2"))
    try:
        url = cluster.replica_urls[0]
        # a reader that stops reading: its small window fills, the replica's write times out, the engine is freed
        slow = open_stream(url, long_stream(6000), rcvbuf=4096)
        wait_until(
            lambda: metric(url, "kvshare_request_slow_client_total") >= 1, 120, "the replica to drop the slow reader"
        )
        wait_until(lambda: health(url)["running"] == 0, 30, "the engine to stop the slow reader's request")
        status, out = completion(url, "and the next one")
        assert status == 200 and out["usage"]["completion_tokens"] == 6
        slow.close()
        # the same through the router: it drops the client, and the replica behind it frees the request
        slow = open_stream(cluster.router_url, long_stream(6000), rcvbuf=4096)
        wait_until(
            lambda: (
                all(health(u)["running"] == 0 and health(u)["waiting"] == 0 for u in cluster.replica_urls)
                and health(cluster.router_url)["replicas"][0]["in_flight"]
                + health(cluster.router_url)["replicas"][1]["in_flight"]
                == 0
            ),
            120,
            "the router and replicas to let go of the slow reader",
        )
        slow.close()
        # a client that leaves mid-stream through the router
        before = sum(metric(u, "kvshare_request_cancelled_total") for u in cluster.replica_urls)
        gone = open_stream(cluster.router_url, long_stream(6000))
        read_until(gone, b"data:")
        gone.shutdown(socket.SHUT_RDWR)
        gone.close()
        wait_until(
            lambda: sum(metric(u, "kvshare_request_cancelled_total") for u in cluster.replica_urls) > before,
            60,
            "a replica to notice the client left",
        )
        wait_until(lambda: all(health(u)["running"] == 0 for u in cluster.replica_urls), 30, "the engines to be idle")
        pool_is_clean(cluster.pool_socket)
        report(
            "slow and vanishing clients",
            slow_client_drops=metric(url, "kvshare_request_slow_client_total"),
            cancelled=sum(metric(u, "kvshare_request_cancelled_total") for u in cluster.replica_urls),
        )
    finally:
        cluster.stop()
