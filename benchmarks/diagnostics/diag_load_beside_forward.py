"""Diagnostic for the H200 (issue 18): which part of the suffix's forward slows a pool load beside it.

Alone, a 256k load of the 8B shape runs at 0.998 of one large copy (session 9); through the service,
beside the forward of the 240-token suffix, at 0.89-0.95 (every service row since session 4), and
neither four staging buffers nor flash attention in place of cuDNN changed that (session 10). This
measures one engine's cross-replica prefill out of a real pool, in one run, by the load's own CUDA
events (``load_end - load_started`` of the request's timeline), against a 1-D copy of 4 GiB out of
registered memory:

    alone           the same load, nothing beside it (PoolLink.load_prefix, then wait)
    forward         the engine's prefill as a request runs it (every page checked)
    no checks       the same, pages not checked
    no attention    the forward with attention replaced by zeros (projections, MLP, waits remain)
    attention only  the forward whose projections and MLP are skipped (attention and waits remain)
    waits only      per layer only the wait for its KV (nothing computed)
    eager enqueue   the forward, every copy enqueued before the compute (TransferConfig.load_enqueue="eager")
    switch 0.1 ms   the forward, Python's GIL switch interval 0.1 ms instead of 5 ms

Every variant also times each unit's copies and scatter by CUDA events on their streams: ``copy_busy``
(sum of the copies' own durations), ``copy_gaps`` (first copy's start to last copy's end, less the busy
time: the copy stream waiting for a free staging buffer or for the enqueue), ``scatter_late`` (sum over
units of scatter start minus its copy's end: a scatter waiting for SMs) and ``scatter_busy``. Slower
copies point at the bus or memory; gaps at the staging pipeline or the host.

The pool holds a random KV of the prompt (stored by the engine itself, so the pages and their checksums
are what a replica would store). Each variant: one warm-up, then REPEATS requests; the median.

Session 11 found the load at 0.99 of the copy beside the forward here, in one process, where the service
rows lose 5-11%; the options below bring the service's surroundings in one by one: ``--pool-bytes`` (the
service's larger arena), ``--other-engine`` (a second process with its own engine on the same GPU,
connected to the pool and its arena registered, idle: the service's other replica), ``--hugepages``
(the arena on reserved 2 MiB pages; they must be reserved first), ``--variants`` (a subset, by name).

    PYTHONPATH=.:/tmp/site python3 benchmarks/diagnostics/diag_load_beside_forward.py [TOKENS [SHAPE [OUT]]] [options]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

import kvshare.engine.model as M
import kvshare.transfer.cuda as TC
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.engine.timeline import Timeline
from kvshare.pool.spawn import running_pool

REPEATS = 3


def reference_copy_gbps() -> float:
    host = torch.empty(4 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    times = []
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return host.numel() / statistics.median(times[1:]) / 1e9


@contextmanager
def patched(variant: str):
    layer_forward = M.DecoderLayer.forward
    attend = M.attend

    def no_attention(q, k, v, start):
        return torch.zeros_like(q)

    def attention_only(self, x, kv, start, cos, sin, chunk, before_attention):
        attn = self.self_attn
        n = x.shape[0]
        q = x.new_zeros(attn.num_heads, n, attn.head_dim)
        before_attention()
        attend(q, kv[0, :, : start + n], kv[1, :, : start + n], start)
        return x

    def waits_only(self, x, kv, start, cos, sin, chunk, before_attention):
        before_attention()
        return x

    try:
        if variant == "no attention":
            M.attend = no_attention
        elif variant == "attention only":
            M.DecoderLayer.forward = attention_only
        elif variant == "waits only":
            M.DecoderLayer.forward = waits_only
        yield
    finally:
        M.attend, M.DecoderLayer.forward = attend, layer_forward


class UnitProbe:
    """CUDA events around each unit's copies (copy stream) and scatter (reshape stream) of the loads in between."""

    def __init__(self, transfer) -> None:
        self.transfer, self.copies, self.scatters = transfer, [], []

    @staticmethod
    def _timed(fn, stream, into):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        fn()
        after.record(stream)
        into.append((before, after))

    @contextmanager
    def active(self):
        host_copies, scatter = self.transfer._host_copies, TC.chunks_to_engine

        def timed_copies(unit, buf, stream, to_device):
            if not to_device:
                return host_copies(unit, buf, stream, to_device)
            self._timed(lambda: host_copies(unit, buf, stream, to_device), stream, self.copies)

        def timed_scatter(*args):
            self._timed(lambda: scatter(*args), torch.cuda.current_stream(), self.scatters)

        self.transfer._host_copies, TC.chunks_to_engine = timed_copies, timed_scatter
        try:
            yield self
        finally:
            self.transfer._host_copies, TC.chunks_to_engine = host_copies, scatter

    def reset(self) -> None:
        self.copies, self.scatters = [], []

    def summary(self) -> dict:
        """Seconds, after the load ended (its events are all complete)."""
        torch.cuda.synchronize()
        ms = lambda a, b: a.elapsed_time(b)  # noqa: E731
        busy = sum(ms(a, b) for a, b in self.copies)
        span = ms(self.copies[0][0], self.copies[-1][1])
        late = [ms(c[1], s[0]) for c, s in zip(self.copies, self.scatters)]
        return {"units": len(self.copies), "copy_busy_s": round(busy / 1e3, 4), "copy_gaps_s": round((span - busy) / 1e3, 4),
                "max_copy_s": round(max(ms(a, b) for a, b in self.copies) / 1e3, 4),
                "scatter_late_s": round(sum(x for x in late if x > 0) / 1e3, 4),
                "max_scatter_late_s": round(max(late) / 1e3, 4),
                "scatter_busy_s": round(sum(ms(a, b) for a, b in self.scatters) / 1e3, 4)}


OTHER_ENGINE = """
import sys
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine
model, sock, positions = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = Engine(EngineConfig(model=model, device="cuda", pool_socket=sock, local_cache_bytes=0, max_model_len=positions))
assert engine._pool.transfer is not None, "the other engine did not connect to the pool"
print("ready", flush=True)
sys.stdin.read()  # idle until the diagnostic closes our stdin
"""


@contextmanager
def other_engine(model: str, sock: str, positions: int):
    """A second process with an engine on the same GPU, connected to the pool (arena registered), idle."""
    proc = subprocess.Popen([sys.executable, "-c", OTHER_ENGINE, model, sock, str(positions)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the other engine did not start (exit {proc.wait()})")
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokens", nargs="?", type=int, default=262128)
    ap.add_argument("shape", nargs="?", default="8b", choices=("8b", "32b"))
    ap.add_argument("out", nargs="?", default="diag_load_beside_forward.json")
    ap.add_argument("--pool-bytes", type=int, default=0, help="the arena's size (default: the KV, +15%%, +2 GiB)")
    ap.add_argument("--hugepages", action="store_true", help="the arena on reserved 2 MiB hugepages")
    ap.add_argument("--other-engine", action="store_true", help="a second, idle engine process on the GPU")
    ap.add_argument("--variants", default="", help="comma list of variant names to run (default: all)")
    args = ap.parse_args()
    tokens, shape, out = args.tokens, args.shape, args.out
    model = {"8b": "qwen3-8b", "32b": "qwen3-32b"}[shape]
    reference = reference_copy_gbps()
    print(f"reference: one 4 GiB copy out of pinned memory {reference:.2f} GB/s", flush=True)
    ids = np.random.default_rng(0).integers(0, 100_000, tokens).astype(np.int64)
    kv_bytes = None
    rows = []
    per_token = {"8b": 36, "32b": 64}[shape] * 2 * 8 * 128 * 2  # KV bytes per token (bf16, 8 KV heads of 128)
    pool_bytes = args.pool_bytes or int(tokens * per_token * 1.15) + (2 << 30)
    pool_bytes -= pool_bytes % (2 << 20)  # hugepages take whole 2 MiB pages
    with running_pool(str(pool_bytes), ("--hugepages",) if args.hugepages else (), quiet=True) as sock, \
            (other_engine(model, sock, tokens + 16) if args.other_engine else _nothing()):
        engine = Engine(EngineConfig(model=model, device="cuda", pool_socket=sock, local_cache_bytes=0,
                                     verify_checksums=True, max_model_len=tokens + 16))
        kv = engine._kv.ensure(tokens + 16)
        kv.normal_(0, 1)
        keys = engine.prompt_chunk_keys(ids)
        engine._pool.store(kv, keys, engine._digest(""), torch.cuda.current_stream())
        kv_bytes = (len(ids) - 1) // engine.layout.chunk_tokens * engine.layout.page_bytes
        print(f"stored {len(keys)} pages ({kv_bytes / 2**30:.1f} GiB)", flush=True)
        params = SamplingParams(max_tokens=1, ignore_eos=True)

        def by_request(engine: Engine) -> tuple[float, float]:
            timeline = Timeline(time.perf_counter())
            started = time.perf_counter()
            list(engine.generate(ids, params, RequestOptions(use_local_cache=False, timeline=timeline)))
            ttft = time.perf_counter() - started
            steps = timeline.as_dict()
            return steps["load_end"] - steps["load_started"], ttft

        def alone(engine: Engine) -> tuple[float, float]:
            link = engine._pool
            reusable = (len(ids) - 1) // engine.layout.chunk_tokens
            started = time.perf_counter()
            load = link.load_prefix(engine._kv.ensure(tokens + 16), keys[:reusable], 0)
            load.handle.wait_all()
            seconds = load.handle.seconds
            link.finish_load(load)
            return seconds, time.perf_counter() - started

        variants = [("alone", alone, "forward"), ("forward", by_request, "forward"),
                    ("no checks", by_request, "forward"), ("no attention", by_request, "no attention"),
                    ("attention only", by_request, "attention only"), ("waits only", by_request, "waits only"),
                    ("eager enqueue", by_request, "forward"), ("switch 0.1 ms", by_request, "forward"),
                    ("alone (again)", alone, "forward"), ("forward (again, last)", by_request, "forward")]
        if args.variants:
            wanted = args.variants.split(",")
            unknown = set(wanted) - {v[0] for v in variants}
            if unknown:
                raise SystemExit(f"unknown variants {sorted(unknown)}")
            variants = [v for v in variants if v[0] in wanted]
        transfer = engine._pool.transfer
        default_config, default_switch = transfer.config, sys.getswitchinterval()
        for name, measure, patch in variants:
            checked = name != "no checks"  # the link's and its client's flag: every page, or none
            engine._pool.verify_checksums = engine._pool.client.verify_checksums = checked
            transfer.config = (dataclasses.replace(default_config, load_enqueue="eager") if name == "eager enqueue"
                               else default_config)
            sys.setswitchinterval(1e-4 if name == "switch 0.1 ms" else default_switch)
            probe = UnitProbe(transfer)
            with patched(patch), torch.inference_mode():
                measure(engine)  # warm-up
                results, probes = [], []
                with probe.active():
                    for _ in range(REPEATS):
                        probe.reset()
                        results.append(measure(engine))
                        probes.append(probe.summary())
            transfer.config, _ = default_config, sys.setswitchinterval(default_switch)
            load_s = statistics.median(r[0] for r in results)
            gbps = kv_bytes / load_s / 1e9
            middle = sorted(range(REPEATS), key=lambda i: results[i][0])[REPEATS // 2]  # the median load's units
            row = {"variant": name, "load_s": round(load_s, 4), "gbps": round(gbps, 2), "ratio": round(gbps / reference, 3),
                   "host_s": round(statistics.median(r[1] for r in results), 4), **probes[middle]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "model": model, "tokens": tokens, "kv_bytes": kv_bytes,
                   "pool_bytes": pool_bytes, "hugepages": args.hugepages, "other_engine": args.other_engine,
                   "reference_gbps": round(reference, 2), "rows": rows}, f, indent=1)


@contextmanager
def _nothing():
    yield None


if __name__ == "__main__":
    main()
