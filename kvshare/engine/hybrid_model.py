"""The Qwen3.5 / 3.6 dense hybrid in plain torch: Gated DeltaNet layers between gated full-attention layers.

Imports only torch and the engine's torch-only pieces (kvshare.engine.model: RoPE, attention, MLP, logits;
kvshare.engine.gdn: the delta rule and the causal conv; kvshare.engine.gdn_state: the sequence's state).
Parameter names are transformers' ``Qwen3_5ForCausalLM`` names (``model.layers.0.linear_attn.in_proj_qkv.weight``;
a published checkpoint's ``model.language_model.`` prefix is mapped by the loader). ``config`` is a
kvshare.engine.config.ModelConfig with layer_types (duck-typed).

One sequence's state lives in two places, both written by a forward over tokens [start, start + T)::

    kv      [L_att, 2, H, T_cap, D]   the attention layers' KV (the engine's tensor; L_att attention layers only)
    state   GDNState at ``start``     per GDN layer: recurrent [HV, K, V] float32 and conv [C, W-1]; a forward
                                      from anywhere but ``state.position`` is refused, and one from 0 resets it

A GDN layer runs over the tokens in segments (at most ``chunk_tokens`` each, cut also at every position a
checkpoint is asked for), carrying its state from one to the next; an attention layer as the attention models'
(all queries at once, projections and MLP in chunks). Norms are Qwen3.5's: x * rsqrt(mean(x^2) + eps) * (1 + w)
in float32 (the GDN's output norm: w * x, gated by SiLU(z)); attention's output is gated by sigmoid of q_proj's
second half; RoPE turns the first ``rotary_dim`` dims of each head.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import sdpa_kernel

from kvshare.engine.gdn import TorchGDN, conv_state_after, mask_padding
from kvshare.engine.gdn_state import Checkpoint, GDNState
from kvshare.engine.hybrid_config import state_layout_of
from kvshare.engine.model import (
    MLP,
    Transformer,
    apply_rope,
    attend,
    rope_cos_sin,
    rope_inv_freq,
    sdpa_backends,
    write_kv,
)

TORCH_GDN = TorchGDN()
FULL_ATTENTION = "full_attention"


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: float32 throughout, scaled by (1 + weight), cast back last."""

    fused = None  # no fused kernel computes this form (kvshare.engine.fused reads the attribute)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """The GDN's output norm: weight * norm(x) in x's dtype, times SiLU(gate) in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        x32 = x.float()
        h = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim * 2, bias=c.qkv_bias)  # query | gate
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        self.q_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x: [n, E] normed -> q [n, Hq, D], k [n, H, D] (after RoPE), v [n, H, D], gate [n, Hq*D]."""
        n, d = x.shape[0], self.head_dim
        query_gate = self.q_proj(x).view(n, self.num_heads, 2 * d)
        q, gate = query_gate[..., :d], query_gate[..., d:].reshape(n, self.num_heads * d)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, d))
        v = self.v_proj(x).view(n, self.num_kv_heads, d)
        return partial_rope(q, cos, sin), partial_rope(k, cos, sin), v, gate

    def output(self, out: Tensor, gate: Tensor) -> Tensor:
        """o_proj of attention's output [n, Hq*D] gated by sigmoid(gate) [n, Hq*D]."""
        return self.o_proj(out * torch.sigmoid(gate))


def partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half) on the first cos.shape[-1] dims of x [n, heads, D]; the rest pass through."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)


class GatedDeltaNet(nn.Module):
    kernels = None  # the GPU kernels where the engine chose them (kvshare.engine.gdn_kernels); None: torch

    def __init__(self, config) -> None:
        super().__init__()
        c, la = config, config.linear_attention
        self.num_key_heads, self.num_value_heads = la.num_key_heads, la.num_value_heads
        self.key_head_dim, self.value_head_dim = la.key_head_dim, la.value_head_dim
        self.key_dim, self.value_dim = la.key_dim, la.value_dim
        self.in_proj_qkv = nn.Linear(c.hidden_size, la.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, la.value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, la.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, la.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(
            la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim, bias=False, padding=la.conv_kernel - 1
        )
        self.dt_bias = nn.Parameter(torch.ones(la.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(la.num_value_heads))
        self.norm = GatedRMSNorm(la.value_head_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(la.value_dim, c.hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,
        recurrent: Tensor,
        conv: Tensor,
        num_valid: int | Tensor | None = None,
        before_last: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x: [n, E] normed rows that follow the state (recurrent [HV, K, V], conv [C, W-1], both updated) -> [n, E].

        Rows from ``num_valid`` on are padding: computed, but the state is left as the valid rows leave it.
        ``before_last``: (recurrent, conv) receiving the state before the last valid row (``num_valid`` a device
        count: a captured tail's prompt-end checkpoint); the rows before it then run the chunked rule and the last
        the one-token step, as a forward cut there computes them."""
        kernels = self.kernels or TORCH_GDN
        n = x.shape[0]
        valid = n if num_valid is None else num_valid
        projected, weight = self.in_proj_qkv(x), self.conv1d.weight[:, 0]
        if before_last is not None:
            before_last[1].copy_(conv_state_after(projected, weight, conv, valid - 1))
        mixed = kernels.conv(projected, weight, conv, valid)  # [n, C]
        q = mixed[:, : self.key_dim].reshape(n, self.num_key_heads, self.key_head_dim)
        k = mixed[:, self.key_dim : 2 * self.key_dim].reshape(n, self.num_key_heads, self.key_head_dim)
        v = mixed[:, 2 * self.key_dim :].reshape(n, self.num_value_heads, self.value_head_dim)
        beta = self.in_proj_b(x).sigmoid()  # [n, HV]: how strongly each token writes
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [n, HV] log decay
        if before_last is not None:
            core = last_apart(kernels, (q, k, v, g, beta), recurrent, valid, before_last[0])
        else:
            g, beta = mask_padding(g, beta, valid)
            rule = kernels.step if n == 1 else kernels.chunk
            core = rule(q, k, v, g, beta, recurrent)  # [n, HV, V]
        z = self.in_proj_z(x).reshape(n * self.num_value_heads, self.value_head_dim)
        out = self.norm(core.reshape(n * self.num_value_heads, self.value_head_dim), z)
        return self.out_proj(out.reshape(n, self.value_dim))


def last_apart(kernels, rows: tuple[Tensor, ...], recurrent: Tensor, num_valid: Tensor, into: Tensor) -> Tensor:
    """The delta rule over rows (q, k, v, g, beta) with the state before the last valid row copied into ``into``:
    the rows before it chunked (the rest masked), the last one stepped; output [n, HV, V] (rows past it padding)."""
    q, k, v, g, beta = rows
    last = (num_valid - 1).reshape(1)
    masked_g, masked_beta = mask_padding(g, beta, last[0])
    core = kernels.chunk(q, k, v, masked_g, masked_beta, recurrent)  # the state after the rows before the last
    into.copy_(recurrent)
    step = kernels.step(*(x.index_select(0, last) for x in rows), recurrent)  # [1, HV, V]
    return core.index_copy(0, last, step)


class HybridLayer(nn.Module):
    """One decoder layer: a token mixer (``self_attn`` or ``linear_attn``), then the MLP; pre-norm residuals."""

    def __init__(self, config, layer_type: str) -> None:
        super().__init__()
        self.is_attention = layer_type == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.mlp = MLP(config)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def mlp_residual(self, h: Tensor) -> Tensor:
        return h + self.mlp(self.post_attention_layernorm(h))

    def linear_step(
        self,
        x: Tensor,
        recurrent: Tensor,
        conv: Tensor,
        num_valid: int | Tensor | None = None,
        before_last: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The whole GDN layer over rows x [n, E] that follow its state: returns the rows' output [n, E]
        (``num_valid``, ``before_last``: GatedDeltaNet.forward's)."""
        h = x + self.linear_attn(self.input_layernorm(x), recurrent, conv, num_valid, before_last)
        return self.mlp_residual(h)


class HybridDecoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(config, kind) for kind in config.layer_types)
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)


class HybridTransformer(nn.Module):
    """The hybrid decoder and its LM head. Inference only: call under torch.inference_mode()."""

    logits = Transformer.logits  # the LM head's float32 logits, as the attention models compute them

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = HybridDecoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq: Tensor | None = None  # [rotary_dim/2], set by setup_buffers
        self.state: GDNState | None = None  # the sequence's GDN state, set by setup_buffers
        self.prefill_attention: Callable[[Tensor, Tensor, Tensor, int], Tensor] | None = None  # kvshare.engine.flash
        # per layer: its index among the GDN layers (its state) or among the attention layers (its KV)
        self.slot = [
            sum(1 for j in range(i) if self.model.layers[j].is_attention == layer.is_attention)
            for i, layer in enumerate(self.model.layers)
        ]

    def setup_buffers(self) -> None:
        """(Re)compute non-parameter state on the weights' device: RoPE's frequencies and a zero GDN state."""
        device = self.model.embed_tokens.weight.device
        self.inv_freq = rope_inv_freq(self.config.rope_dim, self.config.rope_theta, device)
        self.state = GDNState(state_layout_of(self.config), device)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def begin(self, start: int) -> GDNState:
        """The state a forward from ``start`` continues: reset at 0; anywhere else it must end at ``start``."""
        state = self.state
        if start == 0:
            state.reset()
        elif state.position != start:
            raise ValueError(
                f"the GDN state holds the first {state.position} tokens; a forward from position {start} would "
                "combine it with KV it does not belong to (restore the checkpoint at that position first)"
            )
        return state

    def forward(
        self,
        tokens: Tensor,
        kv: Tensor,
        start: int,
        chunk_tokens: int = 4096,
        before_layer: Callable[[int], None] | None = None,
        all_logits: bool = False,
        checkpoints: Mapping[int, Checkpoint] | None = None,
    ) -> Tensor:
        """tokens: [T] at positions [start, start+T) -> float32 logits ([T, V] with ``all_logits``, else [1, V]).

        kv: [L_att, 2, H, T_cap, D], written at those positions; the GDN state advances to start + T.
        ``before_layer(l)`` runs before attention layer l (its index in kv) reads the cache. ``checkpoints``:
        position -> an empty Checkpoint (GDNState.empty_checkpoint), each filled with the state after that
        position's token (start < position <= start + T)."""
        num_tokens = tokens.shape[0]
        if start + num_tokens > kv.shape[3]:
            raise ValueError(f"positions up to {start + num_tokens} exceed the KV capacity {kv.shape[3]}")
        state = self.begin(start)
        checkpoints = checkpoints or {}
        x = self.model.embed_tokens(tokens)  # [T, E]
        cos, sin = rope_cos_sin(self.inv_freq, start, num_tokens, x.dtype)  # [T, rotary_dim]
        spans = segments(start, num_tokens, chunk_tokens, checkpoints)
        last = len(self.model.layers) - 1
        with sdpa_kernel(sdpa_backends(x.is_cuda, num_tokens), set_priority=True):
            for i, layer in enumerate(self.model.layers):
                slot = self.slot[i]
                if not layer.is_attention:
                    for a, b in spans:
                        x[a:b] = layer.linear_step(x[a:b], state.recurrent[slot], state.conv[slot])
                        if start + b in checkpoints:
                            state.copy_layer(slot, checkpoints[start + b])
                    continue
                hook = (lambda slot=slot: before_layer(slot)) if before_layer is not None else None
                x = attention_layer(
                    self, layer, x, kv[slot], start, cos, sin, chunk_tokens, hook, i == last and not all_logits
                )
        state.position = start + num_tokens
        return self.logits_of(x if all_logits else x[-1:], chunk_tokens)

    def logits_of(self, x: Tensor, chunk_tokens: int) -> Tensor:
        """Float32 logits [n, V] of the last layer's rows x [n, E] (final norm, LM head)."""
        out = torch.empty(x.shape[0], self.config.vocab_size, dtype=torch.float32, device=x.device)
        for a in range(0, x.shape[0], chunk_tokens):
            b = min(x.shape[0], a + chunk_tokens)
            self.logits(self.model.norm(x[a:b]), out[a:b])
        return out


def segments(
    start: int, num_tokens: int, chunk_tokens: int, checkpoints: Mapping[int, object]
) -> list[tuple[int, int]]:
    """Row spans [a, b) of a forward over positions [start, start + num_tokens) that a GDN layer runs one after
    another: at most ``chunk_tokens`` rows each, cut at every checkpoint position::

        rows    |---- chunk ----|-- to a checkpoint --|-- rest of a chunk --|-- tail --|
    """
    cuts = {min(num_tokens, a + chunk_tokens) for a in range(0, num_tokens, chunk_tokens)}
    cuts |= {p - start for p in checkpoints if 0 < p - start <= num_tokens}
    ends = sorted(cuts)
    return list(zip([0, *ends[:-1]], ends))


def attention_layer(
    model: HybridTransformer,
    layer: HybridLayer,
    x: Tensor,
    kv: Tensor,
    start: int,
    cos: Tensor,
    sin: Tensor,
    chunk: int,
    before_attention: Callable[[], None] | None,
    last_only: bool,
) -> Tensor:
    """A gated attention layer over x [T, E] (updated in place); kv [2, H, T_cap, D] this layer's KV.

    As the attention models' DecoderLayer: K/V of every token written, attention over all queries at once;
    with ``last_only`` the last token's row alone attends and runs the MLP (returns [1, E])."""
    attn = layer.self_attn
    num_tokens = x.shape[0]
    end = start + num_tokens
    q = x.new_empty(attn.num_heads, num_tokens, attn.head_dim)  # [Hq, T, D]
    gate = x.new_empty(num_tokens, attn.num_heads * attn.head_dim)  # [T, Hq*D]
    for a in range(0, num_tokens, chunk):
        b = min(num_tokens, a + chunk)
        qc, kc, vc, gc = attn.qkv(layer.input_layernorm(x[a:b]), cos[a:b], sin[a:b])
        q[:, a:b] = qc.transpose(0, 1)
        gate[a:b] = gc
        write_kv(kv, start + a, kc, vc)
    if before_attention is not None:
        before_attention()  # e.g. wait until this layer's reused KV has arrived
    if last_only and num_tokens > 1:
        q, x, gate, start, num_tokens = q[:, -1:], x[-1:], gate[-1:], end - 1, 1
        with sdpa_kernel(sdpa_backends(q.is_cuda, 1), set_priority=True):
            out = attend(q, kv[0, :, :end], kv[1, :, :end], start)
    else:
        prefill = model.prefill_attention if model.prefill_attention is not None and num_tokens > 1 else attend
        out = prefill(q, kv[0, :, :end], kv[1, :, :end], start)  # [Hq, T, D]
    del q
    for a in range(0, num_tokens, chunk):
        b = min(num_tokens, a + chunk)
        o = out[:, a:b].transpose(0, 1).reshape(b - a, -1)  # [n, Hq*D]
        x[a:b] = layer.mlp_residual(x[a:b] + attn.output(o, gate[a:b]))
    return x
