"""Diagnostic run on the H200 (2026-12-01; logs in docs/results/h200/decode/): where does a pool load's decode part from local reuse's? Run on the GPU."""
import dataclasses, torch
from kvshare.engine.engine import Engine, SamplingParams
from kvshare.engine.config import EngineConfig
from kvshare.pool.spawn import running_pool
from kvshare.transfer.base import LOAD_ENQUEUE_MODES

n = 16384
ids = [int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))]
params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)


def gen(e):
    ev = list(e.generate(ids, params))
    torch.cuda.synchronize()
    return [(x.token_id, x.logprob, x.top_logprobs) for x in ev], ev[0].provenance


def snap(e):
    return e._kv._kv[:, :, :, : n + 8].clone()


def diff(name, x, y):
    out = [name]
    for region, sl in (("prefix", slice(0, n - 256)), ("suffix", slice(n - 256, n)), ("decode", slice(n, n + 7))):
        a, b = x[:, :, :, sl], y[:, :, :, sl]
        ne = (a != b)
        layers = ne.flatten(1).any(1).nonzero().flatten().tolist()
        out.append(f"{region}: {int(ne.sum())} elements differ, layers {layers[:6]}{'...' if len(layers) > 6 else ''}")
        if layers and region != "prefix":
            l = layers[0]
            pos = ne[l].any(0).any(0).any(-1).nonzero().flatten().tolist()
            out.append(f"   first layer {l}: positions {pos[:10]} (k: {bool(ne[l,0].any())}, v: {bool(ne[l,1].any())})")
    print("\n  ".join(out), flush=True)


def steps(name, x, y):
    d = [i for i, (p, q) in enumerate(zip(x, y)) if p != q]
    print(f"{name}: steps differing {d}; step0 {x[0][:2]} vs {y[0][:2]}", flush=True)


with running_pool("8GiB", ("--extent-size", "256MiB"), quiet=True) as sock:
    cfg = dict(model="qwen3-8b", device="cuda", pool_socket=sock, verify_checksums=True)
    a = Engine(EngineConfig(local_cache_bytes=3 << 30, **cfg))
    cold, p = gen(a); kv_cold = snap(a); print("cold", p)
    local, p = gen(a); kv_local = snap(a); print("local", p)
    local2, p = gen(a); kv_local2 = snap(a); print("local2", p)
    steps("local vs local2", local, local2); diff("kv local vs local2", kv_local, kv_local2)
    steps("cold vs local", cold, local); diff("kv cold vs local", kv_cold, kv_local)
    a.close()
    b = Engine(EngineConfig(local_cache_bytes=3 << 30, **cfg))
    transfer = b._pool.transfer
    pooled = {}
    for mode in LOAD_ENQUEUE_MODES:
        transfer.config = dataclasses.replace(transfer.config, load_enqueue=mode)
        b._local.clear()
        ev, p = gen(b); print(mode, p)
        kv = snap(b)
        steps(f"pooled {mode} vs local", ev, local); diff(f"kv pooled {mode} vs local", kv, kv_local)
        pooled[mode] = (ev, kv)
    blocal, p = gen(b); print("b local", p)
    kv_blocal = snap(b)
    steps("b local vs a local", blocal, local); diff("kv b local vs a local", kv_blocal, kv_local)
    steps("b local vs pooled thread", blocal, pooled["thread"][0]); diff("kv b local vs pooled thread", kv_blocal, pooled["thread"][1])
    # the decode step alone, replayed on the same KV: is decode deterministic?
    kv = b._kv._kv
    kv[:, :, :, : n + 8].copy_(kv_local)
    logits1 = b._decode_step(kv, local[0][0], n).clone()
    kv[:, :, :, : n + 8].copy_(kv_local)
    logits2 = b._decode_step(kv, local[0][0], n).clone()
    print("decode replay deterministic:", torch.equal(logits1, logits2), float((logits1 - logits2).abs().max()))
    kv[:, :, :, : n + 8].copy_(pooled["eager"][1])
    logits3 = b._decode_step(kv, local[0][0], n).clone()
    print("decode on pooled-eager KV equals on local KV:", torch.equal(logits1, logits3), float((logits1 - logits3).abs().max()))
    b.close()
