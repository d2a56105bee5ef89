"""Pool quotas are charged to the tenant, not to the cache_salt it chooses (a real pool, the built-in engine).

Every cache_salt makes its own namespace, so a quota per namespace would let one tenant hold a
quota per salt it sends. The engine names the tenant identity's digest (without the salt) as the
account of what it stores, and the pool charges the account.
"""

from __future__ import annotations

import pytest

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.keys import namespace_digest
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool
from kvshare.serve.tenancy import namespace_salt
from tests.engine.conftest import ascii_prompt

CHUNK = 16
QUOTA_PAGES = 4
PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_and_pool(tiny_dir):
    probe = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=None))
    quota = str(QUOTA_PAGES * probe.layout.page_bytes)
    args = ("--extent-size", "8MiB", "--high-watermark", "1", "--low-watermark", "1", "--namespace-quota", quota)
    with running_pool("64MiB", args, quiet=True) as socket_path:
        # no local cache: every request stores its chunks in the pool
        engine = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=socket_path, local_cache_bytes=0))
        try:
            yield engine, socket_path
        finally:
            engine.close()


def held_bytes(socket_path: str) -> dict[bytes, int]:
    with PoolClient(socket_path) as client:
        return {row.namespace: row.num_bytes for row in client.list_namespaces().accounts}


def send(engine: Engine, tenant: str, salt: str, seed: int, account: str | None) -> None:
    ids = engine.tokenizer.encode(ascii_prompt(4 * CHUNK + 1, seed=seed))  # 4 full chunks
    options = RequestOptions(tenant=namespace_salt(tenant, salt), account=account)
    list(engine.generate(ids, PARAMS, options))


def test_varying_cache_salt_never_holds_more_than_the_tenants_quota(engine_and_pool):
    """Fails when the engine sends no account, or the pool charges the namespace: mallory holds 8 x 4 pages."""
    engine, socket_path = engine_and_pool
    page = engine.layout.page_bytes
    for i in range(8):
        send(engine, "mallory", f"salt-{i}", seed=100 + i, account="mallory")
    for i in range(3):
        send(engine, "alice", f"salt-{i}", seed=200 + i, account="alice")
    held = held_bytes(socket_path)
    mallory = namespace_digest(engine.namespace.with_tenant("mallory"))  # the account: a digest, not the name
    alice = namespace_digest(engine.namespace.with_tenant("alice"))
    assert sum(held.values()) == 2 * QUOTA_PAGES * page, held  # a quota per salt: 8 * 4 + 3 * 4 pages
    assert held.get(mallory) == QUOTA_PAGES * page, held
    assert held.get(alice) == QUOTA_PAGES * page, held  # the other tenant keeps its own quota
    with PoolClient(socket_path) as client:
        client.flush()


def test_without_an_account_each_namespace_is_charged_as_before(engine_and_pool):
    """An older caller (no account) is charged per namespace: each salt holds its own quota."""
    engine, socket_path = engine_and_pool
    page = engine.layout.page_bytes
    for i in range(3):
        send(engine, "legacy", f"salt-{i}", seed=300 + i, account=None)
    held = held_bytes(socket_path)
    salted = [namespace_digest(engine.namespace.with_tenant(namespace_salt("legacy", f"salt-{i}"))) for i in range(3)]
    assert [held.get(ns) for ns in salted] == [QUOTA_PAGES * page] * 3, held
    with PoolClient(socket_path) as client:
        client.flush()
