"""Chunk-invariant prefill on a fixed grid: the engine's deterministic mode.

A prompt's KV computed cold and the same KV computed as a suffix over a reused prefix
differ in the last bits when the two runs cut the work differently: a matmul over 4096
rows and one over 256 rows of the same input need not round alike (cuBLAS's split-K
kernels at small M, oneDNN's blocking on CPU), nor does one causal attention call over
every query and one over the suffix's queries. In bf16 that noise flips greedy tokens.

The grid removes the difference by construction. Positions are cut into grid chunks of
G tokens (a multiple of the pool's chunk), counted from position 0, and every grid
chunk is computed with the same calls on the same shapes in every run::

    positions  |--- grid 0 ---|--- grid 1 ---|--- grid 2 ---|-- tail --......|
               0              G             2G             3G        n     4G
    per layer, per grid chunk j = [s, e):
        norm, q/k/v projections, RoPE   on exactly G rows (the tail zero-padded to G)
        attention                       queries [s, e) over keys [0, e), lower-right causal
        o projection, norm, MLP         on exactly G rows (the tail zero-padded to G)
    the last layer, where only the last token's logits are wanted: K/V as above for every grid chunk;
        attention, o projection, norm, MLP for the last token alone (its one row; nothing reads the others)

A run that reuses a prefix starts at a grid boundary (the engine rounds its reuse down
to the grid), so it makes exactly the calls the cold run makes from there on, on inputs
that are equal bit for bit by induction over positions: the reused KV is the KV the cold
run computed. Only determinism is asked of the kernels (the same call on the same bits
gives the same bits, whatever the buffer's address or capacity); the engine's start-up
self-test (kvshare.engine.grid_check) checks exactly that for the model's shapes on its
device, and refuses the mode where it fails. Attention runs the model's prefill kernel
(FlashAttention's varlen where the engine chose it, kvshare.engine.flash; else SDPA).
Decode steps are unchanged (one token, flash first on CUDA: already deterministic).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvshare.engine.model import Transformer, attend, rope_cos_sin, write_kv

# CUDA: flash first, never cuDNN. Flash's forward is deterministic and was measured query-chunk-invariant on
# the H200; cuDNN's was not invariant at any chunk size, and its one-query kernel not even repeatable
# (model.py). Flash needs fp16/bf16: float32 runs the memory-efficient kernel, or the math one where that
# lacks grouped-query attention (the self-test checks whichever runs).
CUDA_GRID_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CPU_GRID_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class Grid:
    """The deterministic mode of one engine: its grid and the kernel build its exactness rests on."""

    grid_tokens: int  # G: tokens per grid chunk
    chunk_tokens: int  # the pool's chunk (G is a multiple of it)
    kernel_build: str  # what must match across replicas for their pages to be exact (kernel_build())

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0 or self.grid_tokens <= 0 or self.grid_tokens % self.chunk_tokens:
            raise ValueError(
                f"the grid ({self.grid_tokens} tokens) must be a positive multiple of the chunk "
                f"({self.chunk_tokens} tokens)"
            )

    @property
    def chunks_per_grid(self) -> int:
        return self.grid_tokens // self.chunk_tokens

    def reusable_chunks(self, num_chunks: int) -> int:
        """The most pool chunks of a prefix that end on a grid boundary (reuse is rounded down to the grid)."""
        return num_chunks - num_chunks % self.chunks_per_grid

    def usable_prefix(self, local_chunks: int, load) -> tuple[int, int]:
        """(local, pool) chunks a prefill reuses: the prefix held (local chunks, then the pool's PoolLoad ``load``)
        cut at its last grid boundary::

            held   |== local ==|====== pool ======|        a grid of 2 chunks: 5 held, 4 used
            used   |=====|=====|=====|=====|               the pool's 5th chunk is computed again

        A load's copies past the cut land where the prefill writes: they are waited for first.
        """
        held = local_chunks + load.num_chunks
        used = self.reusable_chunks(held)
        if used < held and load.handle is not None:
            load.handle.wait_all()
        return min(local_chunks, used), max(0, used - local_chunks)

    def namespace_fields(self) -> dict:
        """The fields of kvshare.keys.Namespace this mode sets: its pages are kept apart from any other build's."""
        return {"is_deterministic": True, "grid_tokens": self.grid_tokens, "kernel_build": self.kernel_build}


def kernel_build(device: torch.device) -> str:
    """What a replica's kernels depend on, as one string: equal strings, equal kernels (as far as can be told).

    CUDA: the GPU model and compute capability, the driver, torch, the CUDA runtime, cuDNN. CPU: the
    machine, torch's vectorisation level (AVX2 / AVX-512 pick different kernels) and its thread count
    (a reduction split over more threads may round differently).
    """
    if device.type == "cuda":
        # SMs too: a MIG slice of the same GPU may split work otherwise
        props = torch.cuda.get_device_properties(device)
        return "|".join(
            (
                "cuda",
                props.name,
                f"sm_{props.major}{props.minor}",
                f"{props.multi_processor_count} SMs",
                f"driver {_cuda_driver_version()}",
                f"torch {torch.__version__}",
                f"cuda {torch.version.cuda}",
                f"cudnn {torch.backends.cudnn.version()}",
            )
        )
    return "|".join(
        (
            "cpu",
            platform.machine(),
            torch.backends.cpu.get_cpu_capability(),
            f"threads {torch.get_num_threads()}",
            f"torch {torch.__version__}",
        )
    )


def _cuda_driver_version() -> str:
    """The CUDA driver's version (cuDriverGetVersion, e.g. 12080); 'unknown' where libcuda cannot be asked."""
    import ctypes

    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return str(version.value)
    except OSError:
        pass
    return "unknown"


def grid_backends(device: torch.device) -> list[SDPBackend]:
    return CUDA_GRID_BACKENDS if device.type == "cuda" else CPU_GRID_BACKENDS


def grid_attention(model: Transformer) -> Callable[[Tensor, Tensor, Tensor, int], Tensor]:
    """The attention of a grid chunk (``attend``'s signature): the model's prefill kernel, else SDPA."""
    return model.prefill_attention or attend


def grid_forward(
    model: Transformer,
    tokens: Tensor,
    kv: Tensor,
    start: int,
    grid_tokens: int,
    before_layer: Callable[[int], None] | None = None,
    all_logits: bool = False,
) -> Tensor:
    """Prefill ``tokens`` [T] at positions [start, start+T) on the grid; ``start`` must sit on a grid boundary.

    kv: [L, 2, H, T_cap, D] (written at those positions). Returns float32 logits like Transformer.forward:
    [T, V] with ``all_logits``, else [1, V] for the last token. ``before_layer(l)`` runs before layer l's
    first attention reads the cache (a reused prefix's KV arrives layer by layer).
    """
    num_tokens = tokens.shape[0]
    if start % grid_tokens:
        raise ValueError(f"a grid prefill starts on the grid: position {start} is not a multiple of {grid_tokens}")
    if num_tokens < 1 or start + num_tokens > kv.shape[3]:
        raise ValueError(f"positions {start}..{start + num_tokens} do not fit the KV capacity {kv.shape[3]}")
    decoder = model.model
    dtype = decoder.embed_tokens.weight.dtype
    x = decoder.embed_tokens(tokens)  # [T, E]; a row gather, exact
    spans = [(a, min(num_tokens, a + grid_tokens)) for a in range(0, num_tokens, grid_tokens)]  # rows of x
    # RoPE of every grid chunk over its whole G positions (the tail's too): one shape, every run
    ropes = [rope_cos_sin(model.inv_freq, start + a, grid_tokens, dtype) for a, _ in spans]  # [G, D] each
    attention = grid_attention(model)
    last = len(decoder.layers) - 1
    with sdpa_kernel(grid_backends(x.device), set_priority=True):
        for i, layer in enumerate(decoder.layers):
            for j, ((a, b), (cos, sin)) in enumerate(zip(spans, ropes)):
                wait = (lambda i=i: before_layer(i)) if before_layer is not None and j == 0 else None
                if i == last and not all_logits:
                    q = _grid_kv(layer, pad_rows(x[a:b], grid_tokens), b - a, kv[i], start + a, cos, sin, wait)
                else:
                    _grid_step(layer, x[a:b], kv[i], start + a, cos, sin, grid_tokens, wait, attention)
        if not all_logits:
            # the last layer's K/V are written for every token above; its output is read for the last token
            # alone, so only that one row attends and runs its MLP: the same single-row calls in every run
            # that ends on this token, whichever prefix it reused
            h = _last_token(decoder.layers[last], x[-1:], q[-1:], kv[last], start + num_tokens)
            out = torch.empty(1, model.config.vocab_size, dtype=torch.float32, device=x.device)
            model.logits(decoder.norm(h), out)
            return out
    out = torch.empty(num_tokens, model.config.vocab_size, dtype=torch.float32, device=x.device)
    for a, b in spans:
        rows = torch.empty(grid_tokens, model.config.vocab_size, dtype=torch.float32, device=x.device)
        model.logits(decoder.norm(pad_rows(x[a:b], grid_tokens)), rows)
        out[a:b] = rows[: b - a]
    return out


def _grid_kv(
    layer,
    h: Tensor,
    m: int,
    kv: Tensor,
    start: int,
    cos: Tensor,
    sin: Tensor,
    before_attention: Callable[[], None] | None,
) -> Tensor:
    """One layer's K/V of one grid chunk (as ``_grid_step`` computes and writes them) from its m rows padded to
    the grid (h [G, E]); returns its queries [m, Hq, D]."""
    q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), cos, sin)
    write_kv(kv, start, k[:m], v[:m])  # [H, m, D] each, in the cache's dtype
    if before_attention is not None:
        before_attention()
    return q[:m]


def _last_token(layer, x: Tensor, q: Tensor, kv: Tensor, end: int) -> Tensor:
    """The layer's output [1, E] for the token at position end-1 (x [1, E], q [1, Hq, D]) over keys [0, end)."""
    out = attend(q.transpose(0, 1), kv[0, :, :end], kv[1, :, :end], end - 1)  # [Hq, 1, D]: one query, no mask
    h = x + layer.self_attn.o_proj(out.transpose(0, 1).reshape(1, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _grid_step(
    layer,
    x: Tensor,
    kv: Tensor,
    start: int,
    cos: Tensor,
    sin: Tensor,
    grid_tokens: int,
    before_attention: Callable[[], None] | None,
    attention: Callable[[Tensor, Tensor, Tensor, int], Tensor] = attend,
) -> None:
    """One layer over one grid chunk: x [m, E] rows at positions [start, start+m), m <= G (updated in place).

    kv: [2, H, T_cap, D] this layer's KV, holding positions [0, start) already.
    """
    m = x.shape[0]
    end = start + m
    h = pad_rows(x, grid_tokens)  # [G, E]
    q = _grid_kv(layer, h, m, kv, start, cos, sin, before_attention)  # [m, Hq, D]
    out = attention(q.transpose(0, 1), kv[0, :, :end], kv[1, :, :end], start)  # [Hq, m, D]
    o = pad_rows(out.transpose(0, 1).reshape(m, -1), grid_tokens)  # [G, Hq*D]
    h = h + layer.self_attn.o_proj(o)
    x.copy_((h + layer.mlp(layer.post_attention_layernorm(h)))[:m])


def pad_rows(x: Tensor, num_rows: int) -> Tensor:
    """x [m, ...] with zero rows appended up to ``num_rows`` (x itself when it has them)."""
    m = x.shape[0]
    if m == num_rows:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, num_rows - m))
