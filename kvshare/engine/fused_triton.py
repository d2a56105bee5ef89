"""The Triton kernels behind kvshare.engine.fused (imported only where they run: Triton is a CUDA dependency).

Each keeps the eager arithmetic of kvshare.engine.model: float32 upcasts, and a rounding to the output's dtype
wherever the eager code holds a bf16/fp16 tensor. Offsets are int64 (a 256k-token activation has more than 2**31
elements); row and element counts are not specialized on, so one compile serves every length.
"""

import triton
import triton.language as tl

VERSION = f"triton {triton.__version__}"


@triton.jit(do_not_specialize=["num_rows"])
def rms_norm(x_ptr, w_ptr, out_ptr, row_stride, num_rows, dim, eps, BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """BLOCK_ROWS rows of ``dim`` per program (both fixed by ``dim``): out = w * (x * rsqrt(mean(x^2) + eps))."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < dim)
    x = tl.load(x_ptr + rows * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=1)[:, None] / dim
    normed = (x * tl.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    out = (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows * dim + cols, out, mask=mask)


@triton.jit
def rope(x_ptr, cos_ptr, sin_ptr, out_ptr, token_stride, heads, half, BLOCK_H: tl.constexpr, D: tl.constexpr):
    """One token per program, every head: out = x * cos + rotate_half(x) * sin, each product rounded."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, D)[None, :]
    mask = (h < heads) & (d < D)
    row = x_ptr + token * token_stride + h * D
    x = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(row + (d + half) % D, mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where(d < half, -partner, partner)
    c = tl.load(cos_ptr + token * D + d).to(tl.float32)
    s = tl.load(sin_ptr + token * D + d).to(tl.float32)
    a = (x * c).to(out_ptr.dtype.element_ty).to(tl.float32)
    b = (rotated * s).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * heads * D + h * D + d, (a + b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n"])
def silu_mul(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = silu(gate) * up, silu rounded to the output's dtype first (as F.silu(gate) * up)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)
