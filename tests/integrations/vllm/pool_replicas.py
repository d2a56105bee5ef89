"""Two vLLM replicas' connector sides over vLLM-shaped CPU tensors and a real pool (no vLLM needed): what
test_pool_roundtrip and test_pool_holds share."""

import pytest
import torch

from kvshare.integrations.vllm.cpu import CpuKVWorker
from kvshare.integrations.vllm.cpu_overlap import LayeredLoads
from kvshare.integrations.vllm.layout import PagedLayout, reference_gather
from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.keys import Namespace, chunk_keys, namespace_digest
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.link import PoolLink
from kvshare.pool.spawn import running_pool

L, H, D, N, C = 2, 2, 64, 32, 64
NUM_BLOCKS = 40
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32", chunk_tokens=C)
NAMESPACE = Namespace("tiny", "f" * 32, "float32", L, H, D, chunk_tokens=C, engine_family="vllm")
POOL_ARGS = ("--extent-size", "4MiB")
LAYERED = pytest.mark.parametrize("layered", [False, True], ids=["before-forward", "layered"])


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Replica:
    """One vLLM replica's connector sides over fake CPU_ATTN KV tensors."""

    def __init__(self, socket_path, name, seed, clock=None, rng=None, layered=False, **config):
        self.layered = layered  # loads copied layer by layer beside the forward, as the connector does on CPU
        self.num_layered = 0  # loads that took that path (the others fell back to a synchronous load)
        self.config = ConnectorConfig(pool_socket=socket_path, chunk_tokens=C, replica=name, **config)
        self.clock = clock or FakeClock()
        self.scheduler = PoolScheduler(
            self.config,
            NAMESPACE,
            LAYOUT.page_bytes,
            N,
            PoolLink(socket_path, f"{name}-sched", clock=self.clock),
            clock=self.clock,
        )
        self.worker = CpuKVWorker(
            LAYOUT,
            PoolLink(socket_path, f"{name}-worker", clock=self.clock),
            verify_fraction=self.config.verify_fraction,
            copy_threads=self.config.copy_threads,
            rng=rng,
            overlap_load=layered,
        )
        gen = torch.Generator().manual_seed(seed)
        self.layers = [torch.randn(NUM_BLOCKS, H, N, 2 * D, generator=gen) for _ in range(L)]
        self.paged = PagedLayout("cpu_attn", NUM_BLOCKS, N, H, D, torch.float32)
        self.worker.register(self.layers, self.paged)

    def run_prefill(self, req_id, prompt, block_ids, local=0, step_tokens=None):
        """Schedule a prompt like vLLM would: lookup, allocate, then prefill steps; returns the load outcome."""
        self.scheduler.add_request(req_id, prompt, None, None)
        external = self.scheduler.match(req_id, local)
        self.scheduler.allocated(req_id, external, local)
        computed, outcome = local + external, None  # vLLM counts loaded tokens as computed
        while computed < len(prompt):
            n = min(step_tokens or len(prompt), len(prompt) - computed)
            plan = self.scheduler.plan_step([ScheduledRequest(req_id, computed, n, block_ids)])
            outcomes = self.load(plan.loads)
            for spec in plan.stores:  # after it
                self.worker.store(spec)
            self.scheduler.on_report(WorkerReport(outcomes))
            outcome = outcomes[0] if outcomes else outcome
            computed += n
        return external, outcome

    def load(self, specs):
        """The step's loads: all before the forward, or (``layered``) each attention layer of the forward
        waiting for its own layer, as the connector runs them on CPU."""
        if not self.layered:
            return [self.worker.load(spec) for spec in specs]
        loads = self.worker.start_loads(list(specs), per_layer=True)
        if isinstance(loads, LayeredLoads):
            self.num_layered += len(loads.loads)
        for index in range(L):  # the forward's attention layers
            loads.wait_layer(index)
        outcomes, all_waited = loads.finish()
        assert all_waited
        by_request = {outcome.req_id: outcome for outcome in outcomes}
        return [by_request[spec.req_id] for spec in specs]

    def tokens(self, start, num, block_ids):
        return torch.stack([reference_gather(layer, self.paged, start, num, block_ids) for layer in self.layers])

    def close(self):
        self.scheduler.close()
        self.worker.close()


@pytest.fixture(name="pool")
def pool_fixture():
    """A running 16 MiB pool's socket path (import ``pool_fixture`` to use it as ``pool``)."""
    with running_pool("16MiB", POOL_ARGS) as path:
        yield path


def pool_stats(path):
    with PoolClient(path, name="test") as client:
        return client.stats()


PROMPT = list(range(3, 303))  # 300 tokens: chunks 0..3 (256 tokens) and a 44-token tail
BLOCKS_A = list(range(0, 10))
BLOCKS_B = list(range(39, 29, -1))  # other blocks, in another order


def plan_load_of_a_prefill(a: "Replica", b: "Replica"):
    """A prefills PROMPT into the pool; B matches all 256 tokens of it and plans their load (returned)."""
    a.run_prefill("r1", PROMPT, BLOCKS_A)
    b.scheduler.add_request("r2", PROMPT, None, None)
    assert b.scheduler.match("r2", 0) == 256
    b.scheduler.allocated("r2", 256, 0)
    return b.scheduler.plan_step([ScheduledRequest("r2", 256, 44, BLOCKS_B)])


def flip_a_byte_of_chunk_2(pool):
    keys = chunk_keys(namespace_digest(NAMESPACE), PROMPT, C)
    with PoolClient(pool, name="vandal") as client:
        pages = client.lookup(keys, LAYOUT.page_bytes, lease=False).pages
        client.page(pages[2].offset, LAYOUT.page_bytes)[1000] ^= 0xFF
