"""Diagnostic run on the H200 (2026-12-01; logs in docs/results/h200/decode/): is the engine's decode step deterministic on CUDA, per SDPA backend?"""
import torch
from torch.nn.attention import SDPBackend
import kvshare.engine.model as M
from kvshare.engine.engine import Engine, SamplingParams
from kvshare.engine.config import EngineConfig

n = 16384
ids = [int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))]
params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
e = Engine(EngineConfig(model="qwen3-8b", device="cuda", local_cache_bytes=3 << 30))
first = list(e.generate(ids, params))
kv = e._kv._kv
saved = kv[:, :, :, : n + 8].clone()
token = first[0].token_id
orders = {
    "default (cudnn first)": M.CUDA_SDPA_BACKENDS,
    "flash first": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cudnn only": [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH],
    "efficient first": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}
original = M.CUDA_SDPA_BACKENDS
for name, backends in orders.items():
    M.CUDA_SDPA_BACKENDS = backends
    outs = []
    for _ in range(30):
        kv[:, :, :, : n + 8].copy_(saved)
        outs.append(e._decode_step(kv, token, n).clone())
        k_written = kv[:, :, :, n].clone()
        outs[-1] = (outs[-1], k_written)
    distinct_logits = len({o[0].cpu().numpy().tobytes() for o in outs})
    distinct_kv = len({o[1].float().cpu().numpy().tobytes() for o in outs})
    spread = max(float((o[0] - outs[0][0]).abs().max()) for o in outs)
    print(f"decode x30, {name}: {distinct_logits} distinct logits, {distinct_kv} distinct KV at position n, max |dlogit| {spread:.3g}", flush=True)
    runs = []
    for _ in range(4):
        runs.append([(x.token_id, x.logprob) for x in e.generate(ids, params)])
    same = [r == runs[0] for r in runs]
    print(f"   local-hit generate x4: equal to the first: {same}", flush=True)
M.CUDA_SDPA_BACKENDS = original
e.close()
