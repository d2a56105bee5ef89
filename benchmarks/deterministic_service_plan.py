"""The plan of benchmarks/deterministic_service_gpu.py, pure: per model its layout (two replicas together, or
one at a time against one pool), context, local cache and pool sizes, and its steps with their estimated
seconds on A and on B (the script skips a step whose estimate would end past its time budget).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30

# Estimates (seconds), H200: the fast mode's cold prefill is a x + b x^2 with x = n / 32768 (8B: 1.9 s at 32k,
# 13 s at 128k; 32B: 5.6 s and 46 s); the mode at grid 2048 runs at MODE_SPEED of it (docs/results/
# deterministic/). Decode per token at 32k (x 0.5 + 0.5 x) and the starts are from the session-4 service run.
FAST_FIT = {"qwen3-8b": (1.45, 0.45), "qwen3-32b": (3.63, 1.97), "tiny": (0.0725, 0.0225)}
MODE_SPEED = 0.8
DECODE_S = {"qwen3-8b": 0.03, "qwen3-32b": 0.05, "tiny": 0.01}
START_S = {"qwen3-8b": (60.0, 35.0), "qwen3-32b": (100.0, 45.0), "tiny": (15.0, 8.0)}  # (kvshare up of two, one serve)
WEIGHT_BYTES = {"qwen3-8b": 16.4e9, "qwen3-32b": 65.5e9, "tiny": 0.0}
GPU_RESERVE = 6e9  # activations and CUDA contexts of the replicas, beside weights, KV and local caches
GPU_SHARE = 0.90  # of the free GPU memory the plan may fill
MIN_LOCAL_CACHE = GiB  # smaller, the local step reuses too little to show anything


def cold_s(model: str, n: int, device: str) -> float:
    """The mode's cold prefill of n tokens (CPU: a rough dry-run figure)."""
    a, b = FAST_FIT.get(model, FAST_FIT["qwen3-32b"])
    x = n / 32768
    fast = a * x + b * x * x
    return fast / MODE_SPEED if device != "cpu" else fast * 20


def request_s(model: str, n: int, computed: int, max_tokens: int, device: str) -> float:
    """One completion of an n-token prompt of which ``computed`` tokens are computed (the rest loaded)."""
    x = max(n / 32768, 0.05)
    prefill = cold_s(model, n, device) - cold_s(model, n - computed, device)
    return prefill + max_tokens * DECODE_S.get(model, 0.05) * (0.5 + 0.5 * x) + 1.0 + 0.25 * x


def reused_tokens(n: int, grid: int, limit: int | None = None) -> int:
    """Tokens a request reuses: whole grid chunks, at least one prompt token computed, at most ``limit``."""
    cap = n - 1 if limit is None else min(n - 1, limit)
    return cap // grid * grid


@dataclass(frozen=True)
class Step:
    name: str
    kind: str  # case | control | session
    tokens: int
    a_s: float  # estimated seconds of its requests on A (a session: all of it)
    b_s: float  # estimated seconds of its requests on B


@dataclass(frozen=True)
class ModelPlan:
    """One model's cluster and steps (pure: from the arguments and the GPU's free bytes)."""

    model: str
    layout: str | None  # None: does not fit, see reason
    reason: str | None
    max_model_len: int
    local_cache_bytes: int
    pool_size: str  # the pool's --size, e.g. "62GiB"
    vocab: int
    start_s: float  # until A answers
    swap_s: float  # sequential: A stopped, B answering (together: 0)
    steps: tuple[Step, ...]
    skipped: tuple[str, ...]  # steps the layout cannot run, with the reason


def fit_layout(
    requested: str, replica_bytes: float, want_local: int, free_bytes: int | None
) -> tuple[str | None, int, str | None]:
    """(layout, local cache bytes, why none fits): together if two replicas fit, else sequential (one at a time)."""
    if free_bytes is None:  # CPU: memory is not the limit of a dry run
        return ("together" if requested == "auto" else requested), want_local, None
    budget = GPU_SHARE * free_bytes - GPU_RESERVE
    for layout, replicas in (("together", 2), ("sequential", 1)):
        if requested not in ("auto", layout):
            continue
        room = budget / replicas - replica_bytes
        if room >= MIN_LOCAL_CACHE:
            return layout, int(min(want_local, room)), None
    return (
        None,
        0,
        (
            f"no layout ({requested}) fits: a replica needs {replica_bytes / 1e9:.1f} GB (weights and KV) "
            f"and a 1 GiB local cache, {free_bytes / 1e9:.0f} GB free"
        ),
    )


def fit_prompt(model: str, n: int, max_tokens: int) -> int:
    """A case's prompt length within the model's positions with room for its tokens (32B at 131072: 131008)."""
    from kvshare.engine.presets import PRESETS

    preset = PRESETS.get(model)
    return n if preset is None else min(n, preset.config.max_position_embeddings - max_tokens)


def plan_model(args, model: str, free_bytes: int | None) -> ModelPlan:
    from kvshare.engine.presets import get_preset

    cfg = get_preset(model).config
    kv_token, grid, m, dev = cfg.kv_bytes_per_token, args.grid_tokens, args.max_tokens, args.device
    cases = [n for name, n in args.case_list if name == model]
    sessions = [n for name, n in args.session_list if name == model]
    session_len = {n: n + args.turns * (args.turn_tokens + m) for n in sessions}
    longest = max([*cases, *session_len.values()])
    max_model_len = min(
        -(-(longest + m + args.chunk_tokens) // args.chunk_tokens) * args.chunk_tokens, cfg.max_position_embeddings
    )
    want_local = args.local_cache_size or max([*cases, *sessions]) * kv_token * 21 // 20 + args.chunk_tokens * kv_token
    layout, local, reason = fit_layout(
        args.layout, WEIGHT_BYTES.get(model, 0.0) + max_model_len * kv_token, want_local, free_bytes
    )
    control = min(cases) if cases and not args.no_control else None
    stored = sum(cases) + (control or 0) + sum(session_len.values())  # every prompt's pages, held until B reads them
    pool = args.pool_size or f"{-(-stored * kv_token * 5 // 4 // GiB) + 2}GiB"  # below the pool's 0.95 watermark

    def full(n: int) -> float:
        return request_s(model, n, n, m, dev)

    def cross(n: int) -> float:
        return request_s(model, n, n - reused_tokens(n, grid), m, dev)

    steps = [
        Step(
            f"{model} case {n}",
            "case",
            n,
            2 * full(n) + request_s(model, n, n - reused_tokens(n, grid, local // kv_token), m, dev),
            cross(n),
        )
        for n in cases
    ]
    if control is not None:
        steps.insert(1, Step(f"{model} control {control}", "control", control, 2 * full(control), cross(control)))
    skipped = []
    for n in sessions:
        name = f"{model} session {n}"
        if layout == "sequential":
            skipped.append(f"{name} (a session needs A and B up at once: the together layout)")
        else:
            steps.append(Step(name, "session", n, args.turns * (full(n) + cross(n)), 0.0))
    together_s, one_s = START_S.get(model, START_S["qwen3-32b"])
    sequential = layout == "sequential"
    return ModelPlan(
        model=model,
        layout=layout,
        reason=reason,
        max_model_len=max_model_len,
        local_cache_bytes=local,
        pool_size=pool,
        vocab=cfg.vocab_size,
        start_s=one_s + 5.0 if sequential else together_s,
        swap_s=one_s + 6.0 if sequential else 0.0,
        steps=tuple(steps),
        skipped=tuple(skipped),
    )
