
import torch
import torch.nn.functional as F

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine
from kvshare.engine.fused import TritonKernels, set_fused
from kvshare.engine.model import apply_rope, rms_norm

k = TritonKernels()
g = torch.Generator().manual_seed(0)
x = (torch.randn(333, 5, 128, generator=g) * 2).to("cuda", torch.bfloat16)
ang = torch.rand(333, 128, generator=g) * 100
cos, sin = ang.cos().to("cuda", torch.bfloat16), ang.sin().to("cuda", torch.bfloat16)
a, b = k.rope(x, cos, sin), apply_rope(x, cos, sin)
d = (a.float() - b.float()).abs()
print("rope ne", (a != b).sum().item(), "of", a.numel(), "max", d.max().item())
xr = x.reshape(-1, 128)
w = torch.randn(128, generator=g).to("cuda", torch.bfloat16)
a, b = k.rms_norm(xr, w, 1e-6), rms_norm(xr, w, 1e-6)
print("norm ne", (a != b).sum().item(), "max", (a.float() - b.float()).abs().max().item())
gt, up = (
    (torch.randn(64, 3000, generator=g) * 4).to("cuda", torch.bfloat16),
    torch.randn(64, 3000, generator=g).to("cuda", torch.bfloat16),
)
a, b = k.silu_mul(gt, up), F.silu(gt) * up
print("silu ne", (a != b).sum().item(), "max", (a.float() - b.float()).abs().max().item())
e = Engine(EngineConfig(model="tiny", device="cuda", dtype="bfloat16", local_cache_bytes=0, max_model_len=4096))
c = e.model_config
ids = torch.randint(4, 250, (1500,), generator=torch.Generator().manual_seed(7)).to("cuda")
kv = torch.zeros(c.num_layers, 2, c.num_kv_heads, 1600, c.head_dim, device="cuda", dtype=torch.bfloat16)


class Only:
    def __init__(s, which):
        s.which = which

    def rms_norm(s, x, w, eps):
        return k.rms_norm(x, w, eps) if s.which == "rms_norm" else rms_norm(x, w, eps)

    def rope(s, x, c_, s_):
        return k.rope(x, c_, s_) if s.which == "rope" else apply_rope(x, c_, s_)

    def silu_mul(s, g_, u):
        return k.silu_mul(g_, u) if s.which == "silu_mul" else F.silu(g_) * u


with torch.inference_mode():
    set_fused(e.model, None)
    ref = e.model(ids, kv.clone(), 0, all_logits=True)
    again = e.model(ids, kv.clone(), 0, all_logits=True)
    print("eager repeat max", (again - ref).abs().max().item(), "scale", ref.abs().max().item())
    for which in ("rms_norm", "rope", "silu_mul"):
        set_fused(e.model, Only(which))
        out = e.model(ids, kv.clone(), 0, all_logits=True)
        print(
            which,
            "logit max diff",
            (out - ref).abs().max().item(),
            "argmax eq",
            (out.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        )
    # an SDPA vs flash-like perturbation: eager in float32 norms vs bf16
    set_fused(e.model, k)
    out = e.model(ids, kv.clone(), 0, all_logits=True)
    print("all", (out - ref).abs().max().item(), (out.argmax(-1) == ref.argmax(-1)).float().mean().item())
