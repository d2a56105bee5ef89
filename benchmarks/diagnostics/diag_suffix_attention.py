"""Diagnostic for the H200 (issue 18): the suffix forward over a cached prefix, per suffix length.

A pool load of a prompt whose length is not a whole number of chunks leaves a short suffix to compute
(23 tokens at 30999); on the H200 such a load's forward ended 41 ms after its last copy against 1.9 ms
for a 256-token suffix (diag_suffix_shapes.py). Here, without a pool: the whole suffix forward of the
Qwen3-8B shape over a cached prefix per (prefix, suffix), and one layer's attention alone under each
SDPA backend that takes it (the default order first). Prints one JSON line per case.

    PYTHONPATH=.:/tmp/site python3 benchmarks/diagnostics/diag_suffix_attention.py [MODEL]
"""
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import kvshare.engine.model as M
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine


def timed(fn, repeats=5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


model = sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b"
engine = Engine(EngineConfig(model=model, device="cuda", local_cache_bytes=0))
kv = engine._kv.ensure(33024)
kv.normal_()
c = engine.model_config
cases = [(32512, 256), (30976, 23), (30976, 24), (30976, 32), (30976, 64), (30976, 128), (30976, 255), (16384, 116),
         (16384, 128), (32512, 1)]
backends = {"default": M.CUDA_SDPA_BACKENDS, "flash": [SDPBackend.FLASH_ATTENTION],
            "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH], "cudnn": [SDPBackend.CUDNN_ATTENTION]}
with torch.inference_mode():
    for start, q_len in cases:
        tokens = torch.randint(0, 150000, (q_len,), device="cuda")
        row = {"prefix": start, "suffix": q_len,
               "forward_ms": round(timed(lambda: engine.model(tokens, kv, start, engine.config.prefill_chunk_tokens)), 3)}
        q = torch.randn(c.num_heads, q_len, c.head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = kv[0, 0, :, : start + q_len], kv[0, 1, :, : start + q_len]
        for name, order in backends.items():
            try:
                with sdpa_kernel(order, set_priority=name == "default"):
                    row[f"attend_{name}_ms"] = round(timed(lambda: M.attend(q, k, v, start)), 3)
            except RuntimeError as exc:
                row[f"attend_{name}_ms"] = f"refused: {str(exc).splitlines()[0][:80]}"
        print(json.dumps(row), flush=True)
