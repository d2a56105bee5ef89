"""Helpers of the reliability suite: clusters, HTTP calls, metrics, pool checks, load in the background."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from kvshare.launch import Cluster, ClusterConfig, free_port_block
from kvshare.pool.client import PoolClient
from kvshare.reliability.load import LoadConfig, LoadRun

CHECK_BODY_KEYS = {"message", "type", "param", "code"}


def start(policy: str = "round_robin", replicas: int = 2, pool_size: str = "512MiB", **kw) -> Cluster:
    """A `kvshare up` cluster of the tiny model on free loopback ports."""
    cfg = ClusterConfig(
        num_replicas=replicas,
        policy=policy,
        port=free_port_block(replicas + 1),
        pool_size=pool_size,
        ready_timeout_s=120,
        **kw,
    )
    return Cluster(cfg).start()


def call(
    url: str,
    path: str,
    body=None,
    headers: dict | None = None,
    method: str | None = None,
    raw: bytes | None = None,
    timeout: float = 120,
) -> tuple[int, dict]:
    """(status, parsed JSON body) of one request; HTTP errors are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        url + path, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def is_openai_error(body: dict) -> bool:
    return (
        isinstance(body.get("error"), dict) and CHECK_BODY_KEYS <= set(body["error"]) and bool(body["error"]["message"])
    )


def completion(url: str, prompt, headers: dict | None = None, max_tokens: int = 6, **extra) -> tuple[int, dict]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        **extra,
    }
    return call(url, "/v1/completions", body, headers)


def cold(url: str, prompt, headers: dict | None = None, max_tokens: int = 6) -> list[int]:
    """Token ids of the pool-off, cache-off reference."""
    status, out = completion(url, prompt, headers, max_tokens, kvshare={"use_pool": False, "use_local_cache": False})
    assert status == 200, out
    assert out["kvshare"]["pool_tokens"] == 0 and out["kvshare"]["local_tokens"] == 0
    return out["choices"][0]["token_ids"]


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """A replica's (or the router's) Prometheus sample, summed over labels; 0 when absent."""
    req = urllib.request.Request(url + "/metrics", headers=headers or {})
    text = urllib.request.urlopen(req, timeout=30).read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{")
    )


def health(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/health", timeout=30).read())


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)


def pool_is_clean(socket_path: str, timeout_s: float = 15.0) -> dict:
    """No lease or reservation left (within timeout_s), and the daemon's index and allocator agree."""
    with PoolClient(socket_path, name="test-check") as client:
        stats = wait_until(
            lambda: (s := client.stats())["leases"] == 0 and s["reservations"] == 0 and s,
            timeout_s,
            "the pool to hold no leases or reservations",
        )
        client.check_integrity()
        return stats


class BackgroundLoad:
    """kvshare load's LoadRun in a thread; ``result()`` joins it and returns the summary."""

    def __init__(self, url: str, **kw) -> None:
        self.config = LoadConfig(url=url, **kw)
        self._summary: dict | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import asyncio

        try:
            self._summary = asyncio.run(LoadRun(self.config).run())
        except BaseException as exc:  # re-raised in the test's thread
            self._error = exc

    def result(self) -> dict:
        self._thread.join(self.config.deadline_s + 30)
        assert not self._thread.is_alive(), "the load did not stop by itself"
        if self._error is not None:
            raise self._error
        return self._summary


def report(test: str, **figures) -> None:
    """One line of figures for docs/reliability.md (shown with pytest -s: grep '^RELIABILITY ')."""
    print("RELIABILITY " + json.dumps({"test": test, **figures}), flush=True)


def load_figures(summary: dict) -> dict:
    keys = ("elapsed_s", "ok", "errors", "rate_limited", "unfinished", "checked", "mismatches", "requests_per_s")
    return {k: summary[k] for k in keys} | {
        "p50_s": summary["latency_s"].get("p50"),
        "p99_s": summary["latency_s"].get("p99"),
        "tokens_by_source": summary["tokens_by_source"],
    }
