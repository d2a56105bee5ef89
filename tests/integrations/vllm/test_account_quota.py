"""vLLM replicas charge pool quotas to the account the router signs, never to the cache_salt a client picks.

The connector's two sides against a real pool with a 4-page quota, over vLLM-shaped CPU tensors (no vLLM
needed). Every cache_salt makes its own namespace, so a quota per namespace would let a client hold a quota
per salt it sends. A request carries its account in ``kv_transfer_params["kvshare"]`` with the router's
tag (kvshare.router.accounts.vllm_body); without a valid tag it is charged to the model's one shared account.
"""

import dataclasses

import pytest
import torch

from kvshare.integrations.vllm.cpu import CpuKVWorker
from kvshare.integrations.vllm.layout import PagedLayout
from kvshare.integrations.vllm.metadata import StorePart, WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig, TransferParams
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.keys import Namespace, namespace_digest
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.link import PoolLink
from kvshare.pool.spawn import running_pool
from kvshare.router.accounts import vllm_body

L, H, D, N, C = 2, 2, 64, 32, 64
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32", chunk_tokens=C)
NAMESPACE = Namespace("tiny", "a" * 32, "float32", L, H, D, chunk_tokens=C, engine_family="vllm")
QUOTA_PAGES = 4
KEY = "account-key-0123456789abcdef"
BLOCKS = tuple(range(9))  # 8 full blocks of N tokens: the prompt's 4 chunks and its tail
NUM_SALTS = 8


def prompt(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(4 * C + 5)]  # 4 full chunks


def signed(account: str, key: str = KEY) -> dict:
    """kv_transfer_params as the router forwards them (its own encoding, read back)."""
    import msgspec

    body = vllm_body("POST", "/v1/completions", b'{"prompt": [1]}', key, account, None)
    return msgspec.json.decode(body)["kv_transfer_params"]


def account_of(account: str) -> bytes:
    """The pool account the connector names for ``account``: the namespace salted by the account alone."""
    return namespace_digest(dataclasses.replace(NAMESPACE, tenant_salt=account))


@pytest.fixture
def pool():
    args = (
        "--extent-size",
        "4MiB",
        "--high-watermark",
        "1",
        "--low-watermark",
        "1",
        "--namespace-quota",
        str(QUOTA_PAGES * LAYOUT.page_bytes),
    )
    with running_pool("16MiB", args, quiet=True) as path:
        yield path


def held(path: str) -> dict[bytes, int]:
    """Arena bytes each quota owner (account, or namespace for a writer that names none) holds."""
    with PoolClient(path, name="test") as client:
        return {row.namespace: row.num_bytes for row in client.list_namespaces().accounts}


class Replica:
    """A replica's connector sides: the scheduler, and one worker rank over fake CPU_ATTN tensors."""

    def __init__(self, path: str, account_key: str = KEY) -> None:
        config = ConnectorConfig(pool_socket=path, chunk_tokens=C, replica="r")
        self.scheduler = PoolScheduler(
            config, NAMESPACE, LAYOUT.page_bytes, N, PoolLink(path, "quota-sched"), account_key=account_key
        )
        self.worker = CpuKVWorker(LAYOUT, PoolLink(path, "quota-worker"))
        self.worker.register(
            [torch.randn(len(BLOCKS), H, N, 2 * D) for _ in range(L)],
            PagedLayout("cpu_attn", len(BLOCKS), N, H, D, torch.float32),
        )

    def prefill(self, req_id: str, ids: list[int], salt: str | None, params: dict | None) -> None:
        s = self.scheduler
        s.add_request(req_id, ids, salt, params)
        s.allocated(req_id, s.match(req_id, 0), 0)
        plan = s.plan_step([ScheduledRequest(req_id, 0, len(ids), BLOCKS)])
        for spec in plan.stores:
            self.worker.store(spec)
        s.on_report(WorkerReport([]))
        s.finish(req_id)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


def test_varying_cache_salt_without_an_account_never_holds_more_than_one_quota(pool):
    """A client talking to the replica directly (no signed account) with 8 salts.
    Fails when the connector reserves with no account (the pool then charges each salt's namespace: the
    client held 8 x 4 = 32 pages against the 4-page quota on the old code)."""
    page = LAYOUT.page_bytes
    replica = Replica(pool)
    try:
        for i in range(NUM_SALTS):
            replica.prefill(f"r{i}", prompt(i), f"salt-{i}", None)
        forged = signed("eve", key="not-the-replicas-key-0123")  # a tag under another key counts as none
        replica.prefill("forged", prompt(50), "salt-x", forged)
        owners = held(pool)
        assert owners == {account_of(""): QUOTA_PAGES * page}, {k.hex(): v for k, v in owners.items()}
        assert replica.worker.counters.stored_chunks == NUM_SALTS * 4 + 4  # each stored, the oldest evicted
    finally:
        replica.close()


def test_each_signed_account_keeps_its_own_quota_whatever_salts_it_sends(pool):
    """Fails when the scheduler's StoreSpec leaves out the account: mallory's salts each hold 4 pages."""
    page = LAYOUT.page_bytes
    replica = Replica(pool)
    try:
        for i in range(NUM_SALTS):
            replica.prefill(f"m{i}", prompt(i), f"salt-{i}", signed("key:mallory"))
        for i in range(3):
            replica.prefill(f"a{i}", prompt(100 + i), f"salt-{i}", signed("alice"))
        owners = held(pool)
        assert owners == {account_of("key:mallory"): QUOTA_PAGES * page, account_of("alice"): QUOTA_PAGES * page}, {
            k.hex(): v for k, v in owners.items()
        }
    finally:
        replica.close()


def test_a_tensor_parallel_store_is_charged_to_the_signed_account(pool):
    """The scheduler side reserves a TP replica's stores; each rank reports its part and the last commits.
    Fails when the scheduler's reserve leaves out the account: 8 salts then hold 32 pages."""
    page = LAYOUT.page_bytes
    config = ConnectorConfig(pool_socket=pool, chunk_tokens=C, replica="tp")
    scheduler = PoolScheduler(config, NAMESPACE, page, N, PoolLink(pool, "quota-tp"), tp_size=2, account_key=KEY)
    try:
        for i in range(NUM_SALTS):
            ids = prompt(i)
            scheduler.add_request(f"t{i}", ids, f"salt-{i}", signed("bob"))
            scheduler.allocated(f"t{i}", scheduler.match(f"t{i}", 0), 0)
            plan = scheduler.plan_step([ScheduledRequest(f"t{i}", 0, len(ids), BLOCKS)])
            assert plan.stores and all(spec.is_parted for spec in plan.stores)
            parts = [
                StorePart(spec.reservation_id, spec.pool_id, rank, True, (0,) * len(spec.grants))
                for spec in plan.stores
                for rank in range(2)
            ]
            scheduler.on_report(WorkerReport([], parts))
            scheduler.finish(f"t{i}")
        assert held(pool) == {account_of("bob"): QUOTA_PAGES * page}
        assert scheduler.counters.stored_chunks == NUM_SALTS * 4
    finally:
        scheduler.close()


def test_only_an_account_tagged_with_the_replicas_key_is_taken():
    assert TransferParams.from_params(signed("alice"), KEY).account == "alice"
    assert TransferParams.from_params(signed("alice"), "").account is None  # a replica without a key takes none
    assert TransferParams.from_params(signed("alice", key="x" * 20), KEY).account is None
    claimed = {"kvshare": {"account": "alice", "account_tag": signed("mallory")["kvshare"]["account_tag"]}}
    assert TransferParams.from_params(claimed, KEY).account is None  # another account's tag
    assert TransferParams.from_params({"kvshare": {"account": "alice"}}, KEY).account is None
    assert TransferParams.from_params({"kvshare": {"account": 7, "account_tag": 7}}, KEY).account is None
    assert TransferParams.from_params(signed("alice") | {"kvshare": {"use_pool": False}}, KEY) == TransferParams(
        use_pool=False
    )
    assert TransferParams.from_params(signed("alice", key="x" * 20), KEY).is_account_refused
    assert not TransferParams.from_params(signed("alice"), KEY).is_account_refused
    assert not TransferParams.from_params({"kvshare": {}}, KEY).is_account_refused
