"""One replica process of benchmarks/vllm_harness_gpu.py (started by it; not meant to be run by hand).

The connector's two sides (PoolScheduler, and kvshare.integrations.vllm.worker's WorkerHooks over the GPU worker,
the very objects KVShareConnector forwards vLLM's calls to) over vLLM-0.32-shaped flash-attention
KV tensors, driven in the order vLLM's GPU model runner calls them, per step::

    scheduler  get_num_new_matched_tokens (match) -> update_state_after_alloc (allocated)
               -> build_connector_meta (plan_step)
    worker     start_load_kv -> per layer: [KV update of the step's tokens] wait_for_layer_load, attention,
               save_kv_layer -> wait_for_save -> get_block_ids_with_load_errors -> build_connector_worker_meta
               -> request_finished

The compute is a real decoder layer of the preset's shape (kvshare.engine.model.DecoderLayer, random
weights; ONE layer's weights applied at every one of the L layers to save memory), attention reading
the layer's KV gathered out of the paged blocks into a contiguous [2, H, T, D] scratch.

Role A: a store pass without compute (store bandwidth), the prompt's prefix as one cold step, then the
suffix as a second step over its own KV (the computation B repeats), logits saved. Role B (a fresh
process): load-only steps with and without verification, the real step (load + suffix compute), the
suffix's compute alone, logits saved. Each role also times one contiguous pinned copy of the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import time

import numpy as np
import torch

from kvshare.engine.model import (
    CUDA_DECODE_SDPA_BACKENDS,
    CUDA_SDPA_BACKENDS,
    DecoderLayer,
    RMSNorm,
    rope_cos_sin,
    rope_inv_freq,
)
from kvshare.engine.presets import PRESETS
from kvshare.integrations.vllm.cpu import CpuKVWorker
from kvshare.integrations.vllm.gpu import GpuKVWorker
from kvshare.integrations.vllm.layout import as_bits, slots_of_positions
from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.integrations.vllm.paged_destination import widen, word_bytes
from kvshare.integrations.vllm.paged_tensors import paged_layers
from kvshare.integrations.vllm.prompt_chunks import tokens_to_load
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.integrations.vllm.worker import KVWorker, WorkerHooks
from kvshare.keys import Namespace
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.link import PoolLink

BLOCK_SIZE, CHUNK, VOCAB, SEED, MLP_CHUNK = 16, 256, 4096, 1234, 4096


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_of(num_tokens: int) -> list[int]:
    """The case's prompt, the same in both replicas."""
    return torch.randint(0, VOCAB, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens)).tolist()


def prefix_len(num_tokens: int) -> int:
    """Tokens B loads (and A computes in its first step): whole chunks, block-aligned, one token left."""
    return tokens_to_load(num_tokens, 0, CHUNK, 0, num_tokens // CHUNK, BLOCK_SIZE)


class Model:
    """One decoder layer of the preset's shape applied at every layer, an embedding and a small LM head."""

    def __init__(self, preset: str, device: torch.device) -> None:
        self.config = c = PRESETS[preset].config
        self.device, self.dtype = device, getattr(torch, c.dtype)
        gen = torch.Generator(device=device).manual_seed(SEED)
        with torch.device(device):
            self.layer = DecoderLayer(c).to(self.dtype)
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps).to(self.dtype)
        with torch.no_grad():
            for name, p in self.layer.named_parameters():
                if p.dim() == 2:  # [out, in]: std 1/sqrt(fan_in), as the presets draw them
                    p.copy_(torch.randn(p.shape, generator=gen, device=device) / math.sqrt(p.shape[1]))
                elif name.endswith("bias"):
                    p.zero_()
        self.embed = torch.randn(VOCAB, c.hidden_size, generator=gen, device=device).to(self.dtype)
        self.head = torch.randn(VOCAB, c.hidden_size, generator=gen, device=device) / math.sqrt(c.hidden_size)
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, device)


class Replica:
    def __init__(self, args) -> None:
        self.args, self.device = args, torch.device(args.device)
        self.model = Model(args.preset, self.device)
        c = self.model.config
        self.layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype, CHUNK)
        self.prompt = prompt_of(args.tokens)
        num_blocks = -(-args.tokens // BLOCK_SIZE) + 8
        self.kv_layers, self.paged = paged_layers(
            "LBNHC", c.num_layers, num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, self.model.dtype, self.device
        )
        blocks = list(range(num_blocks))
        self.block_ids = blocks if args.role == "A" else blocks[::-1]  # B: descending, as a long-running vLLM
        # [2, B, N, H, D'] views of each layer as wide integers, as the connector's GPU path indexes them
        self.word_bytes = word_bytes(self.kv_layers, self.paged)
        self.blocks = [widen(self.paged.kv_blocks(as_bits(layer)), self.word_bytes) for layer in self.kv_layers]
        self.scratch = torch.zeros(
            2, c.num_kv_heads, args.tokens, c.head_dim, dtype=self.model.dtype, device=self.device
        )
        config = ConnectorConfig(pool_socket=args.socket, chunk_tokens=CHUNK, replica=args.role)
        namespace = Namespace(
            f"harness-{args.preset}",
            "0" * 32,
            c.dtype,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            CHUNK,
            engine_family="vllm",
        )
        self.scheduler = PoolScheduler(
            config, namespace, self.layout.page_bytes, BLOCK_SIZE, PoolLink(args.socket, f"{args.role}-s")
        )
        link = PoolLink(args.socket, f"{args.role}-w")
        if self.device.type == "cuda":
            self.worker: KVWorker = GpuKVWorker(self.layout, link)
        else:  # the dry run on CPU
            self.worker = CpuKVWorker(self.layout, link, copy_threads=2)
        started = time.perf_counter()
        self.worker.register(self.kv_layers, self.paged)
        self.worker.prepare()  # connects and registers the arena with CUDA
        self.register_s = time.perf_counter() - started
        self.hooks = WorkerHooks(self.worker, BLOCK_SIZE)
        self.num_requests = 0
        self.probe = Probe(self.worker, self.hooks)
        self.phases: dict[str, list[dict]] = {}  # step name -> each run's phases (Probe.take)

    # -- vLLM's order ----------------------------------------------------------------------------

    def schedule(self, req_id: str, computed: int, num_tokens: int, salt: str | None = None, new: bool = True):
        """The scheduler side of one step: match, allocated, plan_step (build_connector_meta)."""
        s = self.scheduler
        external = 0
        if new:
            s.add_request(req_id, self.prompt, salt, None)
            external = s.match(req_id, computed)
            s.allocated(req_id, external, computed)
        plan = s.plan_step([ScheduledRequest(req_id, computed + external, num_tokens - external, self.block_ids)])
        return plan, external

    def step(self, plan, start: int, end: int, compute: bool = True):
        """The worker side of one step; returns (logits or None, load outcomes, load-error blocks)."""
        h, probe = self.hooks, self.probe
        probe.begin()
        inputs = self.inputs(start, end) if compute else None  # vLLM's _prepare_inputs precedes start_load_kv
        probe.mark("prepare_inputs")
        h.start_load(plan)
        probe.mark("start_load_kv")
        logits = None
        if compute:
            logits = self.forward(start, end, plan, inputs)
        else:
            for index in range(self.layout.num_layers):
                h.wait_layer(index)
                h.save_layer(index, plan)
        probe.mark("forward_enqueued")
        h.wait_for_save(plan)
        probe.mark("wait_for_save")
        errors = h.load_errors()
        outcomes = h.take_outcomes()
        self.scheduler.on_report(WorkerReport(outcomes))
        return logits, outcomes, errors

    def inputs(self, start: int, end: int) -> tuple:
        """The step's device inputs (token ids, rope, slot mappings): uploaded before start_load_kv, as vLLM's
        model runner does. An upload during the step would queue behind the load's copies on the copy engine
        (the H200 trace showed a pageable 256 KiB upload waiting 70 ms for them)."""
        m = self.model
        ids = torch.tensor(self.prompt[start:end], device=self.device)
        cos, sin = rope_cos_sin(m.inv_freq, start, end - start, m.dtype)
        new = slots_of_positions(torch.arange(start, end), self.block_ids, BLOCK_SIZE, self.device)
        old = slots_of_positions(torch.arange(0, start), self.block_ids, BLOCK_SIZE, self.device) if start else None
        return ids, cos, sin, new, old

    def forward(self, start: int, end: int, plan=None, inputs: tuple | None = None) -> torch.Tensor:
        """Tokens [start, end) through every layer; logits [T, VOCAB] (float32). With ``plan``, the hooks
        fire where vLLM's attention layer fires them."""
        m, hooks = self.model, self.hooks if plan is not None else None
        ids, cos, sin, new, old = inputs if inputs is not None else self.inputs(start, end)
        x = m.embed[ids]
        step_kv = self.words(self.scratch[:, :, start:end].permute(0, 2, 1, 3))  # [2, T, H, D'] of this step
        prefix_kv = self.words(self.scratch[:, :, :start].permute(0, 2, 1, 3))  # [2, start, H, D']
        backends = CUDA_SDPA_BACKENDS if start == 0 else CUDA_DECODE_SDPA_BACKENDS  # flash for a suffix: deterministic
        kernels = torch.nn.attention.sdpa_kernel(backends) if self.device.type == "cuda" else contextlib.nullcontext()
        with torch.inference_mode(), kernels:
            for index, blocks in enumerate(self.blocks):

                def before_attention(blocks=blocks, index=index):
                    # vLLM's KV update: the step's K/V into its slots; then wait for the layer's load; then
                    # attention's read of the layer's blocks (gathered into the contiguous scratch)
                    blocks[:, new[0], new[1]] = step_kv
                    if hooks is not None:
                        hooks.wait_layer(index)
                    if old is not None:
                        prefix_kv.copy_(blocks[:, old[0], old[1]])

                x = m.layer(x, self.scratch, start, cos, sin, MLP_CHUNK, before_attention)
                if hooks is not None:
                    hooks.save_layer(index, plan)
            return m.norm(x).float() @ m.head.T

    def words(self, t: torch.Tensor) -> torch.Tensor:
        return widen(as_bits(t), self.word_bytes)

    def timed(self, fn, name: str | None = None):
        """Wall seconds of ``fn`` (device synchronized on both sides); with ``name``, the step's phases are
        kept under it and, with ``--profile``, the first run of each name is traced (kernels and copies)."""
        sync(self.device)
        tracing = bool(name and name not in self.phases and self.args.profile and self.device.type == "cuda")
        context = (
            torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            if tracing
            else contextlib.nullcontext()
        )
        with context as prof:
            started = time.perf_counter()
            result = fn()
            sync(self.device)
            seconds = time.perf_counter() - started
        if name:
            self.phases.setdefault(name, []).append(self.probe.take(seconds))
        if tracing:
            prof.export_chrome_trace(f"{self.args.profile}/{self.args.role}_{name}.json")
        return seconds, result

    def new_id(self, tag: str) -> str:
        self.num_requests += 1
        return f"{tag}{self.num_requests}"

    # -- the roles -------------------------------------------------------------------------------

    def role_a(self) -> dict:
        T, P = self.args.tokens, prefix_len(self.args.tokens)
        out: dict = {"register_s": self.register_s, "prefix_tokens": P}
        # 1. store bandwidth: every full chunk of random KV stored with no compute (a namespace of its own)
        for layer in self.kv_layers:
            as_bits(layer).random_()
        rid = self.new_id("bw")
        plan, _ = self.schedule(rid, 0, T, salt="store-bandwidth")
        digest = self.scheduler._requests[rid].ns_digest
        before = self.worker.counters.store_bytes
        out["store_s"], _ = self.timed(lambda: self.step(plan, 0, T, compute=False), "store")
        out["store_bytes"] = self.worker.counters.store_bytes - before
        self.scheduler.finish(rid)
        with PoolClient(self.args.socket, name="harness-flush") as client:
            client.flush(digest)
        # the same store again: what a replica past its first store pays (the first includes one-time costs)
        rid = self.new_id("bw")
        plan, _ = self.schedule(rid, 0, T, salt="store-bandwidth-again")
        digest = self.scheduler._requests[rid].ns_digest
        out["store_again_s"], _ = self.timed(lambda: self.step(plan, 0, T, compute=False), "store_again")
        self.scheduler.finish(rid)
        with PoolClient(self.args.socket, name="harness-flush") as client:
            client.flush(digest)
        out["pinned_d2h_s"] = pinned_copy_s(out["store_bytes"], self.device, to_device=False)
        # 2. the prefix, cold, storing its chunks; 3. the suffix over A's own KV: what B computes
        for layer in self.kv_layers:
            layer.zero_()
        rid = self.new_id("a")
        plan, _ = self.schedule(rid, 0, P)
        out["cold_step_s"], _ = self.timed(lambda: self.step(plan, 0, P), "cold_step")
        plan, _ = self.schedule(rid, P, T - P, new=False)
        out["suffix_step_s"], (logits, _, _) = self.timed(lambda: self.step(plan, P, T))
        self.scheduler.finish(rid)
        out["stored_chunks"] = self.worker.counters.stored_chunks
        out["phases"] = self.phases
        torch.save(logits.cpu(), self.args.logits)
        return out

    def role_b(self) -> dict:
        T, P = self.args.tokens, prefix_len(self.args.tokens)
        out: dict = {
            "register_s": self.register_s,
            "prefix_tokens": P,
            "load_s": [],
            "load_unverified_s": [],
            "step_s": [],
            "compute_s": [],
            "load_errors": 0,
            "incomplete_loads": 0,
        }

        def load_step(compute: bool):
            rid = self.new_id("b")
            plan, external = self.schedule(rid, 0, T)
            name = "step" if compute else "load" if self.worker.verify_fraction else "load_unverified"
            seconds, (logits, outcomes, errors) = self.timed(lambda: self.step(plan, external, T, compute), name)
            self.scheduler.finish(rid)
            out["load_errors"] += len(errors)
            out["incomplete_loads"] += sum(not o.is_complete for o in outcomes) + (not outcomes)
            out["loaded_tokens"] = external
            return seconds, logits

        for verify in (1.0, 0.0, 1.0, 0.0):  # alternated: the machine's drift falls on both alike
            self.worker.verify_fraction = verify
            out["load_s" if verify else "load_unverified_s"].append(load_step(compute=False)[0])
        self.worker.verify_fraction = 1.0
        self.timed(lambda: self.forward(P, T))  # warm-up of the suffix's kernels (the KV is in place)
        for _ in range(2):
            seconds, logits = load_step(compute=True)
            out["step_s"].append(seconds)
            if len(out["step_s"]) == 1:
                torch.save(logits.cpu(), self.args.logits)
        inputs = self.inputs(P, T)  # prepared outside the timing, as in the real step
        for _ in range(2):
            out["compute_s"].append(self.timed(lambda: self.forward(P, T, None, inputs))[0])
        out["load_bytes_per_step"] = P * self.layout.bytes_per_token
        out["pinned_h2d_s"] = pinned_copy_s(out["load_bytes_per_step"], self.device, to_device=True)
        out["phases"] = self.phases
        return out

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


class Probe:
    """Where a step's time goes: host seconds between the hooks' returns, and the GPU seconds of the step's
    staged loads and stores (their own start/end events), kept by wrapping the worker's two factories."""

    def __init__(self, worker: KVWorker, hooks: WorkerHooks) -> None:
        self.loads, self.stores, self.marks = [], [], []
        for name, kept in (("start_loads", self.loads), ("start_stores", self.stores)):
            original = getattr(worker, name)

            def wrapped(*args, _original=original, _kept=kept, **kwargs):
                made = _original(*args, **kwargs)
                if hasattr(made, "seconds"):  # staged on a GPU (not: nothing to copy, or CPU)
                    _kept.append(made)
                return made

            setattr(worker, name, wrapped)

    def begin(self) -> None:
        self.loads.clear(), self.stores.clear()
        self.marks = [("begin", time.perf_counter())]

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def take(self, wall_s: float) -> dict:
        host = {name: t - self.marks[i][1] for i, (name, t) in enumerate(self.marks[1:])}
        return {
            "wall_s": wall_s,
            "host_s": host,
            "load_gpu_s": [getattr(x, "seconds", None) for x in self.loads],
            "store_gpu_s": [getattr(x, "seconds", None) for x in self.stores],
        }


def pinned_copy_s(num_bytes: int, device: torch.device, to_device: bool, repeats: int = 2) -> float:
    """Best time of ONE contiguous copy of ``num_bytes`` between a pinned host buffer and the device (the reference)."""
    device_bytes = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    if device.type != "cuda":
        host = torch.empty(num_bytes, dtype=torch.uint8)
        pinned = None
    else:
        from kvshare.transfer.registration import register_range

        # page-aligned memory registered like the arena (torch's pinned allocator rounds 18 GiB up to 32)
        pinned = mmap.mmap(-1, num_bytes)
        host = torch.from_numpy(np.frombuffer(pinned, dtype=np.uint8))
        register_range(host.data_ptr(), num_bytes)
    try:
        best = math.inf
        for _ in range(repeats):
            sync(device_bytes.device)
            started = time.perf_counter()
            if to_device:
                device_bytes.copy_(host, non_blocking=True)
            else:
                host.copy_(device_bytes, non_blocking=True)
            sync(device_bytes.device)
            best = min(best, time.perf_counter() - started)
        return best
    finally:
        if pinned is not None:
            from kvshare.transfer.registration import unregister_range

            unregister_range(host.data_ptr())
        del device_bytes
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next step's activations need that memory more


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("A", "B"), required=True)
    parser.add_argument("--preset", required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--logits", required=True, help="where to save this replica's suffix logits")
    parser.add_argument("--result", required=True, help="where to write this replica's figures (JSON)")
    parser.add_argument("--profile", default=None, help="a directory for torch profiler traces of the named steps")
    args = parser.parse_args()
    torch.manual_seed(SEED)
    replica = Replica(args)
    try:
        figures = replica.role_a() if args.role == "A" else replica.role_b()
    finally:
        replica.close()
    with open(args.result, "w") as f:
        json.dump(figures, f)


if __name__ == "__main__":
    main()
