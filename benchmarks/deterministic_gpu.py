"""The engine's deterministic mode on the H200: what cold prefill costs, and pool ON == pool OFF bitwise.

    PYTHONPATH=. python3 benchmarks/deterministic_gpu.py --out DIR [--model qwen3-8b] [--tokens 32768]
        [--grids 256,2048] [--speed-models qwen3-32b] [--max-tokens 64] [--time-budget 200]
    PYTHONPATH=. python3 benchmarks/deterministic_gpu.py --out DIR --device cpu --model tiny --tokens 1024  (a dry run)

One process, one pool daemon it starts. In order, each step only while the time budget lasts:
  1. the self-test (kvshare.engine.grid_check) and, for information, whether this device's attention is
     query-chunk-invariant and its matmuls row-invariant at the model's shapes (the grid relies on neither:
     a faster variant with one attention call over every query would rely on the first);
  2. cold prefill speed, model level, synchronised, best of --repeats after a warm-up: the fast mode
     (one attention call, MLP in 4096-row chunks) against the deterministic mode at each grid of --grids,
     both with an engine's default kernels (the fused element-wise ones; --attention, default auto:
     FlashAttention where a library loads, per grid chunk in the deterministic mode);
  3. exactness in the engine, --max-tokens greedy tokens with top logprobs, grid = the pool chunk:
        A (pool, checksums verified)  cold, pool and local cache off: the reference; then with both on,
                                      which stores every full chunk in the pool and A's local cache
        B (another engine, empty local cache, checksums off)  pool only: cross-replica reuse
        A                             local reuse
        one byte of a pooled page flipped; B pool only again: the negative control, must differ;
        A pool only: its checksum finds the page, drops it and recomputes: equal again
     and, for contrast, the fast mode's pool reuse against its own cold run (an engine F);
  4. the speed step for each of --speed-models at the same length (e.g. the 32B shape).
Step 3 holds engines A and B at once: it is skipped, with the reason, where their weights, KV and A's local
cache do not fit the GPU (the 32B shape on an H200, at 32k already; its exactness runs through the service,
one replica at a time: deterministic_service_gpu.py). The 32B shape's speed at 128k, one command of ~4-5 min:
    python3 benchmarks/deterministic_gpu.py --out DIR --model qwen3-32b --tokens 131072 --repeats 1 \
        --speed-models '' --time-budget 500
Writes DIR/deterministic.json ({"rows": [...], "probes": {...}, ...}); every row has model,
prompt_tokens, cold_speed_vs_fast_mode, tokens_equal and logprobs_equal (null where the row does not
measure it), and a table on stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

ROW_FIELDS = (
    "model",
    "prompt_tokens",
    "check",
    "mode",
    "grid_tokens",
    "cold_speed_vs_fast_mode",
    "tokens_equal",
    "logprobs_equal",
    "expected",
    "passed",
    "first_difference",
    "local_tokens",
    "pool_tokens",
)
CHECKS = {  # check -> what the row must show (None: information only)
    "cross-replica": "equal",
    "local": "equal",
    "flipped byte, checksums off": "differ",
    "flipped byte, checksums on": "equal",
    "fast mode pool reuse (contrast)": None,
    "speed": None,
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="qwen3-8b", help="preset of the exactness runs")
    p.add_argument("--tokens", type=int, default=32768, help="prompt tokens")
    p.add_argument(
        "--grids", default="256,2048", help="grids whose cold prefill is timed (multiples of --chunk-tokens)"
    )
    p.add_argument("--speed-models", default="qwen3-32b", help="presets timed too, if the budget allows ('' for none)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--attention", default="auto", help="prefill attention of both modes (auto: the engine's default)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--time-budget", type=float, default=210.0, help="seconds; a step that would end past it is skipped")
    p.add_argument(
        "--speed-model-s", type=float, default=70.0, help="seconds one --speed-models step needs (32B at 32k)"
    )
    args = p.parse_args(argv)
    args.grid_list = parse_grids(args.grids, args.chunk_tokens)
    if args.chunk_tokens not in args.grid_list:  # the exactness runs' grid is always timed
        args.grid_list.insert(0, args.chunk_tokens)
    args.speed_model_list = [m for m in args.speed_models.split(",") if m.strip()]
    return args


def parse_grids(text: str, chunk_tokens: int) -> list[int]:
    grids = [int(g) for g in text.split(",") if g.strip()]
    if not grids or any(g <= 0 or g % chunk_tokens for g in grids):
        raise ValueError(f"--grids {text!r}: give multiples of the chunk ({chunk_tokens} tokens)")
    return grids


class Budget:
    def __init__(self, seconds: float, clock=time.monotonic) -> None:
        self.seconds, self.clock, self.started = seconds, clock, clock()

    def allows(self, step: str, skipped: list[str], needs_s: float = 0.0) -> bool:
        """True while ``needs_s`` more seconds fit the budget; else the step is named in ``skipped``."""
        elapsed = self.clock() - self.started
        if elapsed + needs_s < self.seconds:
            return True
        skipped.append(f"{step} (budget: {elapsed:.0f} s of {self.seconds:.0f} s used, it needs about {needs_s:.0f} s)")
        return False


def compare_runs(reference: list, candidate: list) -> dict:
    """Two runs' events (token_id, logprob, top_logprobs), bitwise: tokens_equal, logprobs_equal, first_difference."""
    from kvshare.outputs import compare_tokens

    ref_ids, got_ids = [e.token_id for e in reference], [e.token_id for e in candidate]
    logprobs_equal = len(reference) == len(candidate) and all(
        a.logprob == b.logprob and a.top_logprobs == b.top_logprobs for a, b in zip(reference, candidate)
    )
    tops = [[e.logprob, *(e.top_logprobs or {}).values()] for e in reference]
    got_tops = [[e.logprob, *(e.top_logprobs or {}).values()] for e in candidate]
    cmp = compare_tokens(ref_ids, got_ids, tops, candidate_top_logprobs=got_tops, is_exact=True)
    return {
        "tokens_equal": ref_ids == got_ids,
        "logprobs_equal": logprobs_equal,
        "first_difference": None if cmp.is_identical else cmp.describe(),
    }


def make_row(
    model: str,
    tokens: int,
    check: str,
    mode: str,
    grid: int | None,
    speed: float | None,
    comparison: dict | None = None,
    provenance=None,
    **extra,
) -> dict:
    expected = CHECKS[check]
    comparison = comparison or {"tokens_equal": None, "logprobs_equal": None, "first_difference": None}
    exact = comparison["tokens_equal"] is True and comparison["logprobs_equal"] is True
    passed = None if expected is None else (exact if expected == "equal" else not exact)
    row = {
        "model": model,
        "prompt_tokens": tokens,
        "check": check,
        "mode": mode,
        "grid_tokens": grid,
        "cold_speed_vs_fast_mode": speed,
        **comparison,
        "expected": expected,
        "passed": passed,
        "local_tokens": getattr(provenance, "local_tokens", None),
        "pool_tokens": getattr(provenance, "pool_tokens", None),
    }
    return {**row, **extra}


def speed_ratio(fast_s: float | None, deterministic_s: float | None) -> float | None:
    """Cold prefill speed of the mode as a share of the fast mode's (1.0: as fast)."""
    if not fast_s or not deterministic_s:
        return None
    return round(fast_s / deterministic_s, 3)


def flip_offset(element_size: int, element: int = 1000) -> int:
    """Byte offset of the high byte (sign, exponent) of one K value of layer 0 in a canonical page (little-endian)."""
    return element * element_size + element_size - 1


def pool_bytes(page_bytes: int, num_chunks: int, num_namespaces: int) -> int:
    """A pool that holds a prompt's chunks in each namespace with room to spare, in whole GiB."""
    need = page_bytes * (num_chunks + 2) * num_namespaces * 1.25
    return int(-(-need // (1 << 30))) << 30


def weights_bytes(cfg) -> int:
    """Bytes of a model's weights, from its shape: projections and MLP per layer, the embedding and the head."""
    per_layer = (
        cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    tables = (1 if cfg.tie_word_embeddings else 2) * cfg.vocab_size * cfg.hidden_size
    return (4 if cfg.dtype == "float32" else 2) * (cfg.num_layers * per_layer + tables)


def exactness_bytes(cfg, tokens: int, max_tokens: int) -> int:
    """GPU bytes of the exactness step: engines A and B at once (weights, KV of the context), A's local cache
    holding the prompt, and 6 GB of activations and contexts."""
    kv = cfg.kv_bytes_per_token
    return 2 * (weights_bytes(cfg) + (tokens + max_tokens + 8) * kv) + tokens * kv + 6 * 10**9


def exactness_misfit(cfg, name: str, tokens: int, max_tokens: int, gpu_bytes: int | None) -> str | None:
    """Why the exactness step does not fit the GPU (None: it fits, or CPU)."""
    need = exactness_bytes(cfg, tokens, max_tokens)
    if gpu_bytes is None or need <= 0.92 * gpu_bytes:
        return None
    return (
        f"exactness (engines A and B of {name} at {tokens} tokens at once need ~{need / 1e9:.0f} GB, the GPU has "
        f"{gpu_bytes / 1e9:.0f} GB; one replica at a time: deterministic_service_gpu.py --layout sequential)"
    )


def table(rows: list[dict]) -> str:
    cols = (
        "model",
        "prompt_tokens",
        "check",
        "mode",
        "grid_tokens",
        "cold_speed_vs_fast_mode",
        "tokens_equal",
        "logprobs_equal",
        "passed",
    )
    lines = [" | ".join(cols)]
    lines += [" | ".join(str(r.get(c)) for c in cols) for r in rows]
    return "\n".join(lines)


# -- the device parts --------------------------------------------------------------------------------------


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def prompt_ids(n: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(4, min(vocab, 30000), (n,), generator=torch.Generator().manual_seed(n)).tolist()


def speed_step(model, device, tokens: int, grids: list[int], repeats: int) -> dict:
    """Cold prefill seconds: the fast mode and each grid (model level, best of ``repeats`` after a warm-up)."""
    import torch

    from kvshare.engine.grid import grid_forward

    c = model.config
    kv = torch.empty(
        c.num_layers, 2, c.num_kv_heads, tokens, c.head_dim, dtype=model.model.embed_tokens.weight.dtype, device=device
    )
    ids = torch.tensor(prompt_ids(tokens, c.vocab_size), device=device)
    runs = {"fast": lambda n: model(ids[:n], kv, 0, 4096)}
    for g in grids:
        runs[f"grid {g}"] = lambda n, g=g: grid_forward(model, ids[:n], kv, 0, g)
    out = {}
    with torch.inference_mode():
        for name, run in runs.items():
            timed(device, lambda: run(min(tokens, 4097)))  # kernels chosen, workspaces allocated
            out[name] = min(timed(device, lambda: run(tokens)) for _ in range(repeats))
    return out


def invariance_probe(model, device, grid: int, n: int = 4096) -> dict:
    """Information: attention rows per grid chunk (lower-right) vs one causal call; matmul rows of G vs n rows."""
    import torch
    from torch.nn.attention import sdpa_kernel

    from kvshare.engine.grid import grid_backends
    from kvshare.engine.model import attend

    c, dtype = model.config, model.model.embed_tokens.weight.dtype
    g = torch.Generator(device="cpu").manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = rand(c.num_heads, n, c.head_dim), rand(c.num_kv_heads, n, c.head_dim), rand(c.num_kv_heads, n, c.head_dim)
    out = {}
    with torch.inference_mode(), sdpa_kernel(grid_backends(device), set_priority=True):
        whole = attend(q, k, v, 0)
        out["attention_query_chunk_invariant"] = all(
            torch.equal(attend(q[:, s : s + grid], k[:, : s + grid], v[:, : s + grid], s), whole[:, s : s + grid])
            for s in range(0, n, grid)
        )
        layer = model.model.layers[0]
        for name in ("q_proj", "o_proj", "gate_proj", "down_proj"):
            linear = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
            x = rand(n, linear.in_features)
            full = linear(x)
            out[f"{name}_rows_invariant_{grid}_vs_{n}"] = all(
                torch.equal(linear(x[s : s + grid]), full[s : s + grid]) for s in range(0, n, grid)
            )
    return out


def exactness_step(args, device, sock: str, rows: list, budget: Budget, skipped: list) -> None:
    import torch

    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
    from kvshare.keys import chunk_keys, namespace_digest
    from kvshare.pool.client import PoolClient

    cold, pool_only, local_only = (
        RequestOptions(use_pool=False, use_local_cache=False),
        RequestOptions(use_local_cache=False),
        RequestOptions(use_pool=False),
    )
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, logprobs=5)
    n = args.tokens

    def engine(deterministic: bool, verify: bool, local_bytes: int) -> Engine:
        return Engine(
            EngineConfig(
                model=args.model,
                device=args.device,
                pool_socket=sock,
                chunk_tokens=args.chunk_tokens,
                local_cache_bytes=local_bytes,
                verify_checksums=verify,
                max_model_len=n + args.max_tokens + 8,
                deterministic=deterministic,
                grid_tokens=args.chunk_tokens if deterministic else None,  # the pool chunk, as the rows say
                attention=args.attention,
            )
        )

    def run(e: Engine, options) -> list:
        return list(e.generate(ids, params, options))

    a = engine(True, True, 64 << 30)
    ids = prompt_ids(n, a.model_config.vocab_size)
    speed = args.speed.get(args.model)
    row = lambda check, ref, got, **kw: make_row(
        args.model,
        n,
        check,
        "deterministic",
        args.chunk_tokens,
        speed,  # noqa: E731
        compare_runs(ref, got),
        got[0].provenance,
        **kw,
    )
    reference = run(a, cold)
    run(a, RequestOptions())  # stores every full chunk in the pool and the local cache
    b = engine(True, False, 0)
    rows.append(row("cross-replica", reference, run(b, pool_only)))
    rows.append(row("local", reference, run(a, local_only)))
    keys = chunk_keys(namespace_digest(a.namespace), ids, args.chunk_tokens)
    with PoolClient(sock) as client:
        page = client.lookup(keys, a.layout.page_bytes, lease=False).pages[1]
        itemsize = 4 if a.model_config.dtype == "float32" else 2
        client.page(page.offset, page.page_bytes)[flip_offset(itemsize)] ^= 0xFF  # chunk 1, layer 0, a K value
    rows.append(row("flipped byte, checksums off", reference, run(b, pool_only)))
    rows.append(
        row("flipped byte, checksums on", reference, run(a, pool_only), checksum_failures=a.stats().checksum_failures)
    )
    a.close()
    b.close()
    del a, b
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if budget.allows("fast mode contrast", skipped):
        f = engine(False, True, 0)
        reference = run(f, cold)
        run(f, RequestOptions())
        got = run(f, pool_only)
        rows.append(
            make_row(
                args.model,
                n,
                "fast mode pool reuse (contrast)",
                "fast",
                None,
                speed,
                compare_runs(reference, got),
                got[0].provenance,
            )
        )
        f.close()


def model_step(name: str, args, device, rows: list, probes: dict, repeats: int) -> None:
    """Self-test, probes and speed of one preset; fills args.speed[name]."""

    from kvshare.engine.flash import use_attention
    from kvshare.engine.fused import use_fused
    from kvshare.engine.grid_check import check_grid
    from kvshare.engine.presets import build_preset

    model, _, _ = build_preset(name, device)
    model.setup_buffers()
    # the kernels an engine runs by default, in both modes: the fused element-wise ones and the prefill attention
    fused = use_fused(model, device)
    elementwise = "eager" if fused.kernels is None else fused.kernels.name
    attention = use_attention(model, args.attention, device, deterministic=True).name
    started = time.perf_counter()
    results = check_grid(model, device, args.chunk_tokens)
    probes[name] = {
        "attention": attention,
        "elementwise": elementwise,
        "self_test": {r.name: r.is_exact or r.detail for r in results},
        "self_test_s": round(time.perf_counter() - started, 2),
        **invariance_probe(model, device, args.chunk_tokens, min(4096, args.tokens)),
    }
    seconds = speed_step(model, device, args.tokens, args.grid_list, repeats)
    probes[name]["cold_prefill_s"] = {k: round(v, 3) for k, v in seconds.items()}
    for g in args.grid_list:
        ratio = speed_ratio(seconds["fast"], seconds[f"grid {g}"])
        if g == args.chunk_tokens:
            args.speed[name] = ratio
        rows.append(
            make_row(
                name,
                args.tokens,
                "speed",
                "deterministic",
                g,
                ratio,
                cold_fast_s=round(seconds["fast"], 3),
                cold_deterministic_s=round(seconds[f"grid {g}"], 3),
            )
        )
    del model


def main(argv=None) -> int:
    args = parse_args(argv)
    budget, skipped, rows, probes = Budget(args.time_budget), [], [], {}
    args.speed = {}
    import torch

    from kvshare.engine.grid import kernel_build
    from kvshare.engine.loader import resolve_device
    from kvshare.engine.presets import get_preset
    from kvshare.layout import KVLayout
    from kvshare.pool.spawn import running_pool

    device = resolve_device(args.device)
    os.makedirs(args.out, exist_ok=True)
    errors: list[str] = []

    def step(name: str, fn) -> None:
        """Run one step; an error is recorded (the later steps and the JSON still come)."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a probe reports what failed and goes on
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"{name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        finally:
            gc.collect()  # engines and models of the step, before the next allocates its own
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def exactness() -> None:
        cfg = get_preset(args.model).config
        page = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, args.chunk_tokens).page_bytes
        size = pool_bytes(page, args.tokens // args.chunk_tokens, 2)
        watermarks = ("--high-watermark", "1", "--low-watermark", "1", "--extent-size", "1GiB")
        with running_pool(f"{size >> 30}GiB", watermarks, quiet=True) as sock:
            exactness_step(args, device, sock, rows, budget, skipped)

    step(f"speed of {args.model}", lambda: model_step(args.model, args, device, rows, probes, args.repeats))
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    misfit = exactness_misfit(get_preset(args.model).config, args.model, args.tokens, args.max_tokens, gpu_bytes)
    if misfit:
        skipped.append(misfit)
    elif budget.allows("exactness", skipped):
        step("exactness", exactness)
    for name in args.speed_model_list:
        if name != args.model and budget.allows(f"speed of {name}", skipped, needs_s=args.speed_model_s):
            step(f"speed of {name}", lambda name=name: model_step(name, args, device, rows, probes, 1))
    result = {
        "rows": rows,
        "probes": probes,
        "skipped": skipped,
        "errors": errors,
        "kernel_build": kernel_build(device),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "elapsed_s": round(time.monotonic() - budget.started, 1),
        "passed": not errors and all(r["passed"] is not False for r in rows),
    }
    with open(os.path.join(args.out, "deterministic.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(table(rows))
    print(json.dumps({"probes": probes, "skipped": skipped, "errors": errors, "passed": result["passed"]}, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
