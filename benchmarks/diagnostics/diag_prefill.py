"""Diagnostic run on the H200 (2026-12-01; logs in docs/results/h200/decode/): cuDNN attention determinism in prefill and suffix, and decode speed per backend."""
import time, torch
from torch.nn.attention import SDPBackend
import kvshare.engine.model as M
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.engine.config import EngineConfig

n = 16384
ids = [int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))]
one = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=2)
e = Engine(EngineConfig(model="qwen3-8b", device="cuda", local_cache_bytes=3 << 30))
kv = e._kv._kv
off = RequestOptions(use_local_cache=False)
for name, backends in (("cudnn first", M.CUDA_SDPA_BACKENDS), ("flash first", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])):
    M.CUDA_SDPA_BACKENDS = backends
    cold, kvs = [], []
    for _ in range(4):
        ev = list(e.generate(ids, one, off)); torch.cuda.synchronize()
        cold.append((ev[0].logprob, ev[0].top_logprobs)); kvs.append(kv[:, :, :, :n].clone())
    print(f"{name}: cold prefill x4 logprobs equal {[c == cold[0] for c in cold]}, KV equal {[torch.equal(k, kvs[0]) for k in kvs]}", flush=True)
    del kvs
    list(e.generate(ids, one))  # fills the local cache
    suf, kvs = [], []
    for _ in range(6):
        ev = list(e.generate(ids, one)); torch.cuda.synchronize()
        suf.append((ev[0].logprob, ev[0].top_logprobs)); kvs.append(kv[:, :, :, n - 256:n].clone())
    print(f"{name}: suffix over local hit x6 logprobs equal {[c == suf[0] for c in suf]}, KV equal {[torch.equal(k, kvs[0]) for k in kvs]}", flush=True)
    for length in (16384, 32768):
        torch.cuda.synchronize(); e._decode_step(kv, 5, length); torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            e._decode_step(kv, 5, length)
        torch.cuda.synchronize()
        print(f"{name}: decode step at {length}: {(time.perf_counter() - t) / 50 * 1e3:.2f} ms", flush=True)
    for length in (8192, 32768):
        x = [int(t) for t in torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length))]
        list(e.generate(x, one, off)); torch.cuda.synchronize()
        t = time.perf_counter(); list(e.generate(x, one, off)); torch.cuda.synchronize()
        print(f"{name}: cold prefill {length}: {time.perf_counter() - t:.3f} s", flush=True)
e.close()
