"""A plain-torch Llama / Qwen2 / Qwen3 decoder (imports only torch, in the manner of gpt-fast).

Parameter names mirror Hugging Face checkpoints (``model.layers.0.self_attn.q_proj.weight``),
so a safetensors file loads by name and make-model writes a file transformers reads.
``config`` is a kvshare.engine.config.ModelConfig (duck-typed to keep this file torch-only).

The KV of one sequence lives outside the model, in the engine's tensor
``kv: [L, 2, H, T_cap, D]`` (layer, k|v, kv_head, token, head_dim): head-major, so
``kv[l, 0, :, :n]`` is the ``[H, n, D]`` key view that SDPA reads without a copy.
K is stored after RoPE, in the cache's dtype (a float8 cache: clamped and cast, ``write_kv``); attention
upcasts the cache to the model's dtype. A forward over tokens ``[start, start + T)`` writes their K/V at those
positions and attends over ``[0, start + T)``::

    kv tokens  |==== cached (local / pool / earlier steps) ====|---- this forward ----|
               0                                             start              start+T

Attention runs over all T queries at once (one fused SDPA call, or FlashAttention's varlen kernel where the
engine chose it: kvshare.engine.flash): causal (q_len == kv_len) when
start == 0, lower-right aligned causal when a suffix sits over a cached prefix. Only the
projections and the MLP run in token chunks, which bounds activation memory at long context.
Where only the last token's logits are wanted, the last layer writes every token's K/V but attends
and runs its MLP for the last token alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

LOGITS_VOCAB_SLICE = 16384  # rows of a bf16 LM head upcast at a time (16384 x 5120 x 4 B = 320 MiB)
# On CUDA the cuDNN backend ran 20-35% faster than flash for prefill at 32k-128k on the H200; the rest is
# the fallback order. A decode step (one query) goes to flash first: cuDNN's one-query attention gave
# two different results for the same inputs on the H200 (30 repeats, logits up to 0.1 apart) where
# flash gave one, and flash's step was faster too (33 vs 39 ms at 16k, 8B shape).
CUDA_SDPA_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
CUDA_DECODE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """In float32 and cast back before the weight, exactly as the HF reference does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    fused = None  # kvshare.engine.fused's kernels where the engine chose them (one pass instead of ten)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> Tensor:
    """[D/2] inverse frequencies of the default RoPE (float32)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(inv_freq: Tensor, start: int, num_tokens: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin for positions [start, start + num_tokens): each [T, D] in ``dtype``."""
    positions = torch.arange(start, start + num_tokens, device=inv_freq.device, dtype=torch.float32)
    return rope_cos_sin_at(inv_freq, positions, dtype)


def rope_cos_sin_at(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin for the positions in the device tensor ``positions`` [T] (a captured decode step reads its own)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, D]; cos, sin: [T, D]. Rotate-half convention (HF Llama/Qwen)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    fused = None  # kvshare.engine.fused's kernels (RoPE) where the engine chose them

    def __init__(self, config) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [n, E] normed hidden -> q [n, Hq, D], k [n, H, D] (both after RoPE), v [n, H, D]."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = apply_rope if self.fused is None else self.fused.rope
        return rope(q, cos, sin), rope(k, cos, sin), v


def write_kv(kv: Tensor, start: int, k: Tensor, v: Tensor) -> None:
    """kv [2, H, T_cap, D] at positions [start, start+n) <- k, v [n, H, D], cast to the cache's dtype.

    A float8 cache (scale 1.0) saturates at its largest finite value, as vLLM's cast does: torch's CUDA
    cast turns |x| >= 480 into NaN where its CPU cast saturates, so the clamp makes both devices alike.
    """
    n = k.shape[0]
    k, v = _saturated(kv.dtype, k, v)
    kv[0, :, start : start + n] = k.transpose(0, 1)  # [H, n, D]
    kv[1, :, start : start + n] = v.transpose(0, 1)


def write_kv_at(kv: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
    """``write_kv`` at the positions held in the device tensor ``positions`` [n] (a captured decode step's)."""
    k, v = _saturated(kv.dtype, k, v)
    bits = _BITS[kv.element_size()]  # index_copy_ has no float8 kernels; the bytes are what it moves
    kv[0].view(bits).index_copy_(1, positions, k.transpose(0, 1).to(kv.dtype).view(bits))
    kv[1].view(bits).index_copy_(1, positions, v.transpose(0, 1).to(kv.dtype).view(bits))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _saturated(dtype: torch.dtype, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        bound = torch.finfo(dtype).max
        return k.clamp(-bound, bound), v.clamp(-bound, bound)
    return k, v


def attend(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    """q: [Hq, T, D] for positions [start, start+T); k, v: [H, start+T, D] -> [Hq, T, D].

    K and V stored in another dtype than q's (a float8 cache) are upcast to it first: attention computes in
    the model's dtype.
    """
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)  # [H, start+T, D] each: one layer's cache at a time
    num_queries, num_keys = q.shape[1], k.shape[1]
    gqa = q.shape[0] != k.shape[0]
    q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)  # [1, heads, tokens, D]
    if start == 0:  # cold prefill: q_len == kv_len, plain causal
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif num_queries == 1:  # one new token sees every cached token: no mask
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    else:
        # a suffix over a cached prefix: query i sits at position start+i, so causality is aligned to
        # the lower right. is_causal=True would align it top-left (wrong here).
        mask = causal_lower_right(num_queries, num_keys)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out[0]


class MLP(nn.Module):
    fused = None  # kvshare.engine.fused's kernels (SiLU x up) where the engine chose them

    def __init__(self, config) -> None:
        super().__init__()
        c = config
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        kv: Tensor,
        start: int,
        cos: Tensor,
        sin: Tensor,
        chunk: int,
        before_attention: Callable[[], None],
        last_only: bool = False,
        prefill_attention: Callable[[Tensor, Tensor, Tensor, int], Tensor] | None = None,
    ) -> Tensor:
        """x: [T, E] residual stream (updated in place); kv: [2, H, T_cap, D] this layer's KV.

        ``last_only`` (the model's last layer, when only the last token's logits are wanted): every token's
        K/V is still written, but attention, o_proj and the MLP run for the last token alone, which sees
        every key without a mask; returns that token's row [1, E]. After a load from the pool this layer's
        compute is what is left once its KV has arrived: one query instead of a whole suffix's.
        ``prefill_attention`` (``attend``'s signature) replaces SDPA for more than one query."""
        attn = self.self_attn
        num_tokens = x.shape[0]
        end = start + num_tokens
        q = x.new_empty(attn.num_heads, num_tokens, attn.head_dim)  # [Hq, T, D]
        for a in range(0, num_tokens, chunk):
            b = min(num_tokens, a + chunk)
            qc, kc, vc = attn.qkv(self.input_layernorm(x[a:b]), cos[a:b], sin[a:b])
            q[:, a:b] = qc.transpose(0, 1)
            write_kv(kv, start + a, kc, vc)
        before_attention()  # e.g. wait until this layer's reused KV has arrived from the pool
        if last_only and num_tokens > 1:
            q, x, start, num_tokens = q[:, -1:], x[-1:], end - 1, 1
            with sdpa_kernel(sdpa_backends(q.is_cuda, 1), set_priority=True):  # a decode step's backends
                out = attend(q, kv[0, :, :end], kv[1, :, :end], start)  # [Hq, 1, D]
        else:
            attention = prefill_attention if prefill_attention is not None and num_tokens > 1 else attend
            out = attention(q, kv[0, :, :end], kv[1, :, :end], start)  # [Hq, T, D]
        del q
        for a in range(0, num_tokens, chunk):
            b = min(num_tokens, a + chunk)
            o = out[:, a:b].transpose(0, 1).reshape(b - a, -1)  # [n, Hq*D]
            h = x[a:b] + attn.o_proj(o)
            x[a:b] = h + self.mlp(self.post_attention_layernorm(h))
        return x


class Decoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    """The decoder and its LM head. Inference only: call under torch.inference_mode()."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq: Tensor | None = None  # [D/2], set by setup_buffers once weights sit on their device
        # a prefill's attention in place of SDPA (``attend``'s signature; kvshare.engine.flash); None: SDPA
        self.prefill_attention: Callable[[Tensor, Tensor, Tensor, int], Tensor] | None = None

    def setup_buffers(self) -> None:
        """(Re)compute non-parameter state on the weights' device (call after loading or moving)."""
        device = self.model.embed_tokens.weight.device
        self.inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope_theta, device)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        tokens: Tensor,
        kv: Tensor,
        start: int,
        chunk_tokens: int = 4096,
        before_layer: Callable[[int], None] | None = None,
        all_logits: bool = False,
    ) -> Tensor:
        """tokens: [T] at positions [start, start+T); kv: [L, 2, H, T_cap, D] (written at those positions).

        Returns float32 logits: [T, V] with ``all_logits``, else [1, V] for the last token.
        ``before_layer(l)`` runs before layer l's attention reads the cache.
        """
        num_tokens = tokens.shape[0]
        if start + num_tokens > kv.shape[3]:
            raise ValueError(f"positions up to {start + num_tokens} exceed the KV capacity {kv.shape[3]}")
        dtype = self.model.embed_tokens.weight.dtype
        x = self.model.embed_tokens(tokens)  # [T, E]
        cos, sin = rope_cos_sin(self.inv_freq, start, num_tokens, dtype)  # [T, D]
        with sdpa_kernel(sdpa_backends(x.is_cuda, num_tokens), set_priority=True):
            last = len(self.model.layers) - 1
            for i, layer in enumerate(self.model.layers):
                hook = (lambda i=i: before_layer(i)) if before_layer is not None else _no_op
                x = layer(
                    x,
                    kv[i],
                    start,
                    cos,
                    sin,
                    chunk_tokens,
                    hook,
                    last_only=i == last and not all_logits,
                    prefill_attention=self.prefill_attention,
                )
        if not all_logits:
            x = x[-1:]
        out = torch.empty(x.shape[0], self.config.vocab_size, dtype=torch.float32, device=x.device)
        for a in range(0, x.shape[0], chunk_tokens):
            b = min(x.shape[0], a + chunk_tokens)
            self.logits(self.model.norm(x[a:b]), out[a:b])
        return out

    def logits(self, h: Tensor, out: Tensor) -> None:
        """out [n, V] float32 <- h [n, E] @ W^T. bf16/fp16 weights are upcast one vocabulary slice at a
        time: logits rounded to bf16 tie often (steps of 0.125 at |logit| ~ 20), which would make greedy
        choices depend on rounding noise."""
        weight = self.lm_head.weight  # [V, E]
        if weight.dtype == torch.float32:
            torch.matmul(h, weight.t(), out=out)
            return
        if weight.is_cuda and _mm_to_float32(weight.device, weight.dtype):
            # the same products, exact in float32 and summed in float32, without writing a float32 copy of the
            # head first (at 8B: 1.2 GB read instead of ~6 GB moved, ~1.5 ms of every prefill and decode step)
            for v0 in range(0, weight.shape[0], LOGITS_VOCAB_SLICE):
                v1 = min(weight.shape[0], v0 + LOGITS_VOCAB_SLICE)
                out[:, v0:v1] = torch.mm(h, weight[v0:v1].t(), out_dtype=torch.float32)
            return
        h32 = h.float()
        for v0 in range(0, weight.shape[0], LOGITS_VOCAB_SLICE):
            v1 = min(weight.shape[0], v0 + LOGITS_VOCAB_SLICE)
            out[:, v0:v1] = h32 @ weight[v0:v1].float().t()


def sdpa_backends(is_cuda: bool, num_queries: int) -> list[SDPBackend]:
    """SDPA's backends in the order tried, for a forward of ``num_queries`` tokens."""
    if is_cuda:
        return CUDA_DECODE_SDPA_BACKENDS if num_queries == 1 else CUDA_SDPA_BACKENDS
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def _no_op() -> None:
    pass


_MM_TO_FLOAT32: dict[tuple[str, torch.dtype], bool] = {}


def _mm_to_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs on ``device`` for ``dtype`` inputs (tried once)."""
    known = _MM_TO_FLOAT32.get((str(device), dtype))
    if known is None:
        try:
            a = torch.ones(1, 8, dtype=dtype, device=device)
            known = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            known = False
        _MM_TO_FLOAT32[str(device), dtype] = known
    return known
