"""The service level and the audit against live replicas (kvshare up with the tiny model on CPU).

Chunks of 16 tokens keep the prompts short. The replicas of the module's cluster verify no
checksums (so a poisoned page is served, as a page written too early would be) and audit
every request that reused KV.
"""

from __future__ import annotations

import re
import time

import pytest

from kvshare.launch import Cluster, ClusterConfig, free_port_block
from kvshare.validate.report import FAIL, PASS
from kvshare.validate.runner import ValidateConfig
from kvshare.validate.service import ServiceConfig, run_service_level
from kvshare.validate.service_http import POOL_OFF, POOL_ONLY, get_json, request
from tests.validate.conftest import CHUNK, make_engine

LENGTHS = (32, 40, 75)  # two whole chunks; not a multiple of the chunk; several chunks and a tail
REPLICA_ARGS = ("--chunk-tokens", str(CHUNK), "--verify-rate", "0", "--audit-rate", "1")


@pytest.fixture(scope="module")
def cluster():
    config = ClusterConfig(
        num_replicas=2, pool_size="256MiB", port=free_port_block(3), replica_args=REPLICA_ARGS, ready_timeout_s=180
    )
    c = Cluster(config).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def namespace_engine():
    """An in-process engine of the replicas' model and chunking: it names their pool keys."""
    return make_engine(None)


def poison(cluster, engine, prompt_ids: list[int]) -> int:
    """Flip every float's sign in each pooled chunk of the prompt; returns how many pages were poisoned."""
    from kvshare.keys import chunk_keys, namespace_digest
    from kvshare.pool.client import PoolClient

    keys = chunk_keys(namespace_digest(engine.namespace), prompt_ids, CHUNK)
    with PoolClient(cluster.pool_socket) as client:
        pages = client.lookup(keys, engine.layout.page_bytes, lease=False).pages
        for page in pages:
            client.page(page.offset, page.page_bytes)[3::4] ^= 0x80
        return len(pages)


def audit_counts(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    counts = {m.group(1): float(m.group(2)) for m in re.finditer(r"^kvshare_audit_(\w+)_total (\S+)$", text, re.M)}
    counts["pending"] = float(re.search(r"^kvshare_audit_pending (\S+)$", text, re.M).group(1))
    return counts


def wait_idle(url: str, timeout_s: float = 90.0) -> dict[str, float]:
    """The audit counts once the replica has audited everything it sampled."""
    deadline = time.monotonic() + timeout_s
    while (counts := audit_counts(url))["pending"] > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    return counts


def wait_for(url: str, name: str, at_least: float, timeout_s: float = 90.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        counts = audit_counts(url)
        if counts.get(name, 0.0) >= at_least or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def test_service_level_passes_on_a_cluster_it_starts():
    from kvshare.validate.service_run import run_service

    config = ValidateConfig(
        levels=("service",),
        chunk_tokens=CHUNK,
        prompt_lengths=LENGTHS,
        num_chat=2,
        max_tokens=8,
        replica_args=("--verify-rate", "0"),
        seed=1,
    )
    result = run_service(config, "cpu")
    assert result.status == PASS, [(r.name, r.detail) for r in result.rows if r.status != PASS]
    runs = [r for r in result.figures["requests"] if r["run"] == "pool"]
    assert len(runs) == len(LENGTHS) + 2 and all(r["pool"] > 0 and r["identical"] for r in runs)
    assert {r["pool"] for r in runs if r["case"].startswith("completion")} == {32 - CHUNK, 32, 64}  # (n-1)//16 chunks
    assert all(r["local"] > 0 for r in result.figures["requests"] if r["run"] == "local")
    assert "pool loads where expected 5/5" in result.summary


def test_service_level_fails_when_a_page_is_poisoned_between_prime_and_measurement(cluster, namespace_engine):
    poisoned = []

    def after_prime(case, prime):  # only the case under test: the prompts share their first chunks, and the
        ids = prime.prompt_token_ids or case.prompt  # audit of an earlier poisoned case, run while the replica
        if len(ids) == 75:  # idles, drops those chunks, racing the 75-token measurement (seen in CI)
            poisoned.append(poison(cluster, namespace_engine, ids))

    config = ServiceConfig(
        replicas=tuple(cluster.replica_urls),
        max_tokens=8,
        completion_lengths=LENGTHS,
        num_chat=1,
        chunk_tokens=CHUNK,
        seed=2,
    )
    result = run_service_level(config, after_prime)
    assert result.status == FAIL and sum(poisoned) > 0
    rows = {r.name: r for r in result.rows}
    assert rows["completion 75 tok pool"].status == FAIL and "diverged at step" in rows["completion 75 tok pool"].detail
    assert rows["completion 75 tok local"].status == PASS  # the local cache was not poisoned
    assert rows["completion 75 tok pool"].figures["pool"] == 64  # it did load (the wrong KV) from the pool


def test_audit_catches_a_poisoned_page_while_serving_and_drops_its_chunks(cluster, namespace_engine):
    a, b = cluster.replica_urls
    model = get_json(a + "/v1/models")["data"][0]["id"]
    ids = [(7 * i + 3) % 200 + 32 for i in range(70)]  # 4 full chunks and a tail
    before = wait_idle(b)  # audits left by the previous test are done

    clean = [(5 * i + 1) % 200 + 32 for i in range(50)]  # a clean reuse first: audited, no mismatch
    request(a, model, clean, 8, {}, 120)
    assert request(b, model, clean, 8, POOL_ONLY, 120).reused("pool") == 48
    counts = wait_for(b, "checks", before.get("checks", 0) + 1)
    assert counts.get("mismatches", 0) == before.get("mismatches", 0)

    cold = request(a, model, ids, 8, POOL_OFF, 120).token_ids
    request(a, model, ids, 8, {}, 120)  # stores chunks 0..3
    assert poison(cluster, namespace_engine, ids) == 4
    served = request(b, model, ids, 8, POOL_ONLY, 120)  # loads the poisoned pages (no verification)
    assert served.reused("pool") == 64 and served.token_ids != cold
    counts = wait_for(b, "mismatches", before.get("mismatches", 0) + 1)
    assert counts["mismatches"] == before.get("mismatches", 0) + 1
    assert counts["dropped_pool"] - before.get("dropped_pool", 0) == 4

    again = request(b, model, ids, 8, {}, 120)  # nothing left to reuse (pool or b's cache): recomputed, right
    assert (again.reused("pool"), again.reused("local")) == (0, 0) and again.token_ids == cold


def test_service_level_holds_deterministic_replicas_to_the_exact_rule():
    """Replicas started with --deterministic (bf16): pool ON == pool OFF, ids and logprobs, every run."""
    from kvshare.validate.service_run import run_service

    config = ValidateConfig(
        levels=("service",),
        chunk_tokens=CHUNK,
        prompt_lengths=LENGTHS,
        num_chat=1,
        max_tokens=6,
        replica_args=("--verify-rate", "0", "--deterministic", "--dtype", "bfloat16"),
        seed=3,
    )
    result = run_service(config, "cpu")
    assert result.status == PASS, [(r.name, r.detail) for r in result.rows if r.status != PASS]
    records = result.figures["requests"]
    assert records and all(r["exact"] and r["identical"] for r in records)
    assert all(r["pool"] > 0 for r in records if r["run"] == "pool")
    assert f"held to the exact rule, ids and logprobs: {len(records)}" in result.summary
