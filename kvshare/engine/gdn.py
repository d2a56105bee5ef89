"""Gated DeltaNet in plain torch: the chunked gated delta rule, its one-token step, and the causal conv.

Imports only torch. The arithmetic is transformers' reference (``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn`` in ``models/qwen3_5``), for one sequence, with the
state passed in and updated in place, so a prefill can start from a state computed earlier::

    per token t, per value head h (K: key dim, V: value dim; S: [K, V], float32)
        q_t, k_t = l2norm(q_t), l2norm(k_t); q_t /= sqrt(K)
        S  = S * exp(g_t)                                  decay (g_t <= 0)
        S += k_t (beta_t (v_t - S^T k_t))^T                delta rule: write the part of v_t that S mispredicts
        o_t = S^T q_t

The chunked form computes the same over blocks of ``chunk_size`` tokens (a triangular solve per block and one
state update per block); its blocks are counted from the first token given, so two runs agree in every bit
only where they cut the tokens alike (the deterministic mode's grid: kvshare.engine.hybrid_grid). Key heads
are shared by ``value heads / key heads`` value heads each (value head h reads key head h // ratio).

Rows past ``num_valid`` are padding (a grid chunk's tail, a captured tail's unused rows): their decay is 0 and
their strength 0, so they leave the state exactly as the valid rows left it. ``num_valid`` is an int, or a 0-d
int64 tensor on the rows' device (a CUDA graph reads it there: the same graph serves every count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_SIZE = 64  # the chunked rule's block; the GPU kernels' too


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / ||x|| over the last dim (transformers' and the GPU kernels' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def expand_key_heads(x: Tensor, num_value_heads: int) -> Tensor:
    """[n, H, K] -> [n, HV, K]: key head i serves value heads i*r .. i*r + r - 1 (r = HV / H)."""
    ratio = num_value_heads // x.shape[1]
    return x if ratio == 1 else x.repeat_interleave(ratio, dim=1)


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk_size: int = CHUNK_SIZE
) -> Tensor:
    """q, k: [n, H, K]; v: [n, HV, V]; g, beta: [n, HV]; state: [HV, K, V] float32, updated in place.

    Returns the output [n, HV, V] in v's dtype."""
    out_dtype = v.dtype
    num_tokens = v.shape[0]
    q, k = expand_key_heads(q, v.shape[1]), expand_key_heads(k, v.shape[1])
    # [HV, n, D] float32, as the reference computes
    q, k, v = (x.transpose(0, 1).to(torch.float32) for x in (q, k, v))
    beta, decay = beta.transpose(0, 1).to(torch.float32), g.transpose(0, 1).to(torch.float32)
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk_size - num_tokens % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, decay = F.pad(beta, (0, pad)), F.pad(decay, (0, pad))
    heads = v.shape[0]
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(heads, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = decay.reshape(heads, -1, chunk_size)  # [HV, C, B]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = decay.cumsum(dim=-1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [HV, C, B, B]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    block_decay = cum[..., -1].exp()[..., None, None]  # [HV, C, 1, 1]
    s = state.to(torch.float32)
    out = torch.zeros_like(values)
    for i in range(values.shape[1]):
        v_new = values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * block_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    out = out.reshape(heads, -1, out.shape[-1])[:, :num_tokens]  # [HV, n, V]
    return out.transpose(0, 1).to(out_dtype)


def recurrent_gated_delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    """One token: q, k [1, H, K]; v [1, HV, V]; g, beta [1, HV]; state [HV, K, V] float32, updated in place.

    Returns the output [1, HV, V] in v's dtype (the reference's recurrent form)."""
    out_dtype = v.dtype
    q, k = expand_key_heads(q, v.shape[1])[0], expand_key_heads(k, v.shape[1])[0]  # [HV, K]
    q, k = l2norm(q.to(torch.float32)), l2norm(k.to(torch.float32))
    q = q / (q.shape[-1] ** 0.5)
    v32, beta32 = v[0].to(torch.float32), beta[0].to(torch.float32).unsqueeze(-1)  # [HV, V], [HV, 1]
    s = state * g[0].to(torch.float32).exp()[:, None, None]
    predicted = (s * k.unsqueeze(-1)).sum(dim=-2)  # [HV, V]
    s = s + k.unsqueeze(-1) * ((v32 - predicted) * beta32).unsqueeze(-2)
    state.copy_(s)
    return (s * q.unsqueeze(-1)).sum(dim=-2).unsqueeze(0).to(out_dtype)


def causal_conv(x: Tensor, weight: Tensor, conv_state: Tensor, num_valid: int | Tensor | None = None) -> Tensor:
    """SiLU of the depthwise causal conv of x [n, C] over the inputs before it; conv_state [C, W-1], updated in place.

    weight: [C, W]. conv_state holds the last W-1 inputs before x (zeros at position 0); afterwards it holds the
    last W-1 of the first ``num_valid`` rows of x (all of them by default) and those before. Returns [n, C]."""
    num_valid = x.shape[0] if num_valid is None else num_valid
    inputs = torch.cat((conv_state.to(weight.dtype), x.transpose(0, 1).to(weight.dtype)), dim=-1)  # [C, W-1+n]
    conv_state.copy_(_conv_state_at(inputs, num_valid, conv_state.shape[-1]))
    out = F.conv1d(inputs.unsqueeze(0), weight.unsqueeze(1), groups=inputs.shape[0])[0]  # [C, n]
    return F.silu(out).transpose(0, 1).to(x.dtype)


def conv_state_after(x: Tensor, weight: Tensor, conv_state: Tensor, num_rows: int | Tensor) -> Tensor:
    """The conv state [C, W-1] after the first ``num_rows`` rows of x [n, C] that follow ``conv_state`` (unchanged)."""
    inputs = torch.cat((conv_state.to(weight.dtype), x.transpose(0, 1).to(weight.dtype)), dim=-1)  # [C, W-1+n]
    return _conv_state_at(inputs, num_rows, conv_state.shape[-1])


def _conv_state_at(inputs: Tensor, num_rows: int | Tensor, width: int) -> Tensor:
    """Columns [num_rows, num_rows + width) of the inputs [C, width + n]: the last ``width`` before row num_rows."""
    if isinstance(num_rows, Tensor):  # read on the device
        return inputs.index_select(1, num_rows + torch.arange(width, device=inputs.device))
    return inputs[:, num_rows : num_rows + width]


def mask_padding(g: Tensor, beta: Tensor, num_valid: int | Tensor) -> tuple[Tensor, Tensor]:
    """g, beta [n, HV] with rows from ``num_valid`` on set to 0: padding that leaves the state as it was."""
    if isinstance(num_valid, Tensor):
        padding = (torch.arange(g.shape[0], device=g.device) >= num_valid)[:, None]  # [n, 1]
        return g.masked_fill(padding, 0), beta.masked_fill(padding, 0)
    if num_valid >= g.shape[0]:
        return g, beta
    g, beta = g.clone(), beta.clone()
    g[num_valid:] = 0
    beta[num_valid:] = 0
    return g, beta


class TorchGDN:
    """The GDN kernels' interface (``chunk``, ``step``, ``conv``) in plain torch: every device's fallback."""

    name = "torch"

    def chunk(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        return chunk_gated_delta_rule(q, k, v, g, beta, state)

    def step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        return recurrent_gated_delta_step(q, k, v, g, beta, state)

    def conv(self, x: Tensor, weight: Tensor, conv_state: Tensor, num_valid: int | Tensor | None = None) -> Tensor:
        return causal_conv(x, weight, conv_state, num_valid)
