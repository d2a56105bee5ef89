"""The Gated DeltaNet's GPU kernels: flash-linear-attention's Triton kernels where they load and pass a self-test.

On CUDA the chunked delta rule (a prefill, from an initial state, returning the final state) and the one-token
step run flash-linear-attention's ``chunk_gated_delta_rule`` and ``fused_recurrent_gated_delta_rule`` (package
``fla-core``, the extra ``kvshare[hybrid]``; imported only here, only on a CUDA engine of a hybrid model). They
take the key heads as they are (value head h reads key head h // ratio, as kvshare.engine.gdn), L2-normalise q
and k in the kernel and keep the state in float32, as the torch reference does. The causal conv stays torch's
depthwise conv1d (a memory-bound pass, and its state is the canonical [C, W-1] one).

The kernels' results are checked against the torch reference on this device at start-up (the model's head
shapes, from a random state, a prefill and a step); a library that is missing, fails to compile or differs leaves
the torch reference, with a warning that names why (correct, but its chunk loop is slow at long prompts).
``KVSHARE_GDN_KERNELS=torch`` chooses the reference.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvshare.engine.gdn import TorchGDN, causal_conv

log = logging.getLogger(__name__)
CHOICE_ENV = "KVSHARE_GDN_KERNELS"
SELF_TEST_TOKENS = 200  # a prefill of three blocks and a partial one


@dataclass(frozen=True)
class GDNChoice:
    """What a hybrid model's GDN layers run: ``kernels`` (FlaGDN or TorchGDN), and why."""

    kernels: Any
    reason: str


class FlaGDN:
    """flash-linear-attention's kernels behind the interface of kvshare.engine.gdn.TorchGDN."""

    name = "fla"

    def __init__(self) -> None:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        self.version = getattr(fla, "__version__", "unknown")
        self._chunk, self._step = chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    def chunk(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        """As TorchGDN.chunk: q, k [n, H, K]; v [n, HV, V]; g, beta [n, HV]; state [HV, K, V] float32, updated."""
        return self._run(self._chunk, q, k, v, g, beta, state)

    def step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        return self._run(self._step, q, k, v, g, beta, state)

    def conv(self, x: Tensor, weight: Tensor, conv_state: Tensor, num_valid: int | Tensor | None = None) -> Tensor:
        return causal_conv(x, weight, conv_state, num_valid)

    @staticmethod
    def _run(kernel, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        out, final = kernel(
            q=q.unsqueeze(0),
            k=k.unsqueeze(0),
            v=v.unsqueeze(0),
            g=g.to(torch.float32).unsqueeze(0),
            beta=beta.unsqueeze(0),
            initial_state=state.unsqueeze(0),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # out [1, n, HV, V], final [1, HV, K, V] float32
        state.copy_(final[0])
        return out[0]


def choose_gdn_kernels(device: torch.device, dtype: torch.dtype, shapes: dict[str, int]) -> GDNChoice:
    """flash-linear-attention's kernels where they load here and pass the self-test; else the torch reference."""
    if os.environ.get(CHOICE_ENV, "").strip().lower() in ("torch", "0", "off"):
        return GDNChoice(TorchGDN(), f"{CHOICE_ENV}=torch")
    if device.type != "cuda":
        return GDNChoice(TorchGDN(), "not a CUDA device")
    try:
        kernels = FlaGDN()
        self_test(kernels, device, dtype, **shapes)
    except Exception as exc:  # not installed, a compile error, a wrong result: the reference is always right
        log.warning(
            "Gated DeltaNet kernels: the torch reference (slow at long prompts): %s: %s; install fla-core "
            "(pip install kvshare[hybrid]) for flash-linear-attention's",
            type(exc).__name__,
            exc,
        )
        return GDNChoice(TorchGDN(), f"{type(exc).__name__}: {exc}"[:200])
    return GDNChoice(kernels, f"fla {kernels.version}: self-test passed")


def self_test(
    kernels, device: torch.device, dtype: torch.dtype, key_heads: int, value_heads: int, head_dim: int
) -> None:
    """A prefill from a random state, then a step, against the torch reference: outputs and final states agree
    within bf16 rounding. Raises AssertionError naming what differs."""
    g = torch.Generator(device="cpu").manual_seed(0)
    n = SELF_TEST_TOKENS

    def rand(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device)

    q, k = rand(n, key_heads, head_dim).to(dtype), rand(n, key_heads, head_dim).to(dtype)
    v = rand(n, value_heads, head_dim).to(dtype)
    decay = -torch.rand(n, value_heads, generator=g).to(device)  # log decay in (-1, 0]
    beta = torch.rand(n, value_heads, generator=g).to(device=device, dtype=dtype)
    state = rand(value_heads, head_dim, head_dim, scale=0.1)
    reference, ref_state = TorchGDN(), state.clone()
    for name, run in (("chunk", slice(0, n - 1)), ("step", slice(n - 1, n))):
        args = (q[run], k[run], v[run], decay[run], beta[run])
        got = (kernels.chunk if name == "chunk" else kernels.step)(*args, state)
        want = (reference.chunk if name == "chunk" else reference.step)(*args, ref_state)
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2, msg=f"{name}: output")
        torch.testing.assert_close(state, ref_state, rtol=1e-2, atol=1e-2, msg=f"{name}: final state")
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a fault in a kernel surfaces here, inside the test


def use_gdn_kernels(model, device: torch.device) -> GDNChoice:
    """``choose_gdn_kernels`` for a HybridTransformer, set on its GDN layers."""
    linear = model.config.linear_attention
    shapes = {"key_heads": linear.num_key_heads, "value_heads": linear.num_value_heads, "head_dim": linear.key_head_dim}
    if linear.key_head_dim != linear.value_head_dim:
        shapes = {}  # the self-test's shapes assume K == V; such a model runs the reference
    chosen = (
        choose_gdn_kernels(device, model.model.embed_tokens.weight.dtype, shapes)
        if shapes
        else GDNChoice(TorchGDN(), "key and value head dims differ")
    )
    for layer in model.model.layers:
        if not layer.is_attention:
            layer.linear_attn.kernels = chosen.kernels
    return chosen


def linear_build(model) -> str:
    """What the deterministic mode's kernel build adds for a hybrid's GDN kernels ("" for an attention model)."""
    layers = [layer for layer in model.model.layers if not getattr(layer, "is_attention", True)]
    if not layers:
        return ""
    kernels = layers[0].linear_attn.kernels or TorchGDN()
    return f"|gdn {kernels.name} {getattr(kernels, 'version', '')}".rstrip()
