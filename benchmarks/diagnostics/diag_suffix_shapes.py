"""Diagnostic for the H200 (issue 18): does a pool load's forward tail (forward_end - load_end) or its
first token cost more for a prompt length the replica has not served before?

One engine of the Qwen3-8B shape (no local cache) against a pool, warmed up as `kvshare serve` warms
it; per prompt (fresh random ids): a cold request that stores it, then the same prompt loaded from
the pool with a timeline, greedy, top-2 logprobs. Lengths repeat and change, so a cost paid once per
shape shows as a slow first of each length. Prints one JSON line per loaded request, with the load's
bandwidth by its own CUDA events (start -> end) and by the timeline (first copy enqueued on the host
-> load end on the device): where they differ, the copies started late.

    PYTHONPATH=.:/tmp/site python3 benchmarks/diagnostics/diag_suffix_shapes.py [MODEL]
"""
import json
import sys
import time

import numpy as np

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.engine.timeline import Timeline
from kvshare.engine.warmup import warm_up
from kvshare.pool.spawn import running_pool

model = sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b"
lengths = [32768, 32768, 32000, 32000, 30999, 32768, 16500, 16500]
rng = np.random.default_rng(int(time.time()))
params = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=2)
with running_pool("24GiB", quiet=True) as sock:
    engine = Engine(EngineConfig(model=model, device="cuda", pool_socket=sock, local_cache_bytes=0))
    report = warm_up(engine)
    print(json.dumps({"warmup_s": round(report.seconds, 3)}), flush=True)
    for n in lengths:
        ids = rng.integers(0, 150000, n)
        list(engine.generate(ids, params, RequestOptions(use_local_cache=False)))  # cold: stores the chunks
        timeline = Timeline(time.perf_counter())
        before = engine.stats()
        events = list(engine.generate(ids, params, RequestOptions(use_local_cache=False, timeline=timeline)))
        after = engine.stats()
        t = {k: (None if v is None else round(v * 1e3, 2)) for k, v in timeline.as_dict().items()}
        device_s = after.pool_load_seconds - before.pool_load_seconds  # the load's start -> end CUDA events
        num_bytes = after.pool_bytes_loaded - before.pool_bytes_loaded
        print(json.dumps({"tokens": n, "pool_tokens": events[0].provenance.pool_tokens,
                          "device_load_ms": round(device_s * 1e3, 2),
                          "device_load_GBps": round(num_bytes / device_s / 1e9, 2) if device_s else None,
                          "host_load_GBps": round(num_bytes / (t["load_end"] - t["first_copy_enqueued"]) / 1e6, 2),
                          "tail_ms": round(t["forward_end"] - t["load_end"], 2),
                          "sample_ms": round(t["first_token_sampled"] - t["forward_end"], 2),
                          "first_token_ms": t["first_token_sampled"], "timeline_ms": t}), flush=True)
    engine.close()
