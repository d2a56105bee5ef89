"""Size a pool: KV bytes per token of a model and the pool that holds N cached tokens; for a hybrid model (Gated
DeltaNet layers) also the bytes of its state at one position (a checkpoint)."""

from __future__ import annotations

import argparse
import json

from kvshare.commands.serve import DTYPES, add_dtype_argument, add_kv_dtype_argument
from kvshare.units import parse_count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a model directory (config.json) or a preset name")
    p.add_argument(
        "--tokens",
        type=_count,
        required=True,
        help="cached tokens the pool should hold (4096, 100k = 100000, 32K = 32768)",
    )
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per pool page (the replicas' --chunk-tokens)")
    add_dtype_argument(p)
    add_kv_dtype_argument(p)
    p.add_argument("--high-watermark", type=float, default=0.95, help="the pool's eviction threshold")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def _count(text: str) -> int:
    try:
        value = parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--tokens must be at least 1, got {text!r}")
    return value


def plan(config, tokens: int, chunk_tokens: int, dtype: str | None, high_watermark: float) -> dict:
    from kvshare.layout import KVLayout
    from kvshare.units import format_bytes

    layout = KVLayout(config.num_kv_layers, config.num_kv_heads, config.head_dim, dtype or config.dtype, chunk_tokens)
    pages = -(-tokens // chunk_tokens)
    data = pages * layout.page_bytes
    pool = int(data / high_watermark)
    return _state_plan(config) | {
        "layers": layout.num_layers,
        "kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "kv_dtype": layout.dtype,
        "bytes_per_token": layout.bytes_per_token,
        "page_bytes": layout.page_bytes,
        "chunk_tokens": chunk_tokens,
        "tokens": tokens,
        "pages": pages,
        "kv_bytes": data,
        "pool_size_bytes": pool,
        "pool_size": f"{-(-pool // (1 << 30))}GiB",
        "min_extent_size": format_bytes(layout.page_bytes),
    }


def _state_plan(config) -> dict:
    """A hybrid's state per sequence (one checkpoint): its GDN layers' recurrent and conv states; {} for others."""
    if not config.is_hybrid:
        return {}
    from kvshare.engine.hybrid_config import state_layout_of

    state = state_layout_of(config)
    return {
        "gdn_layers": state.num_layers,
        "recurrent_shape": list(state.recurrent_shape),
        "recurrent_dtype": state.recurrent_dtype,
        "conv_shape": list(state.conv_shape),
        "conv_dtype": state.conv_dtype,
        "state_bytes": state.checkpoint_bytes,
    }


def _print_state(result: dict) -> None:
    from kvshare.units import format_bytes

    heads, keys, values = result["recurrent_shape"]
    channels, inputs = result["conv_shape"]
    print(
        f"state: {result['gdn_layers']} Gated DeltaNet layers x (recurrent {heads}x{keys}x{values} "
        f"{result['recurrent_dtype']} + conv {channels}x{inputs} {result['conv_dtype']}) = "
        f"{format_bytes(result['state_bytes'])} per sequence, and per checkpoint (the state at one position)"
    )


def run(args: argparse.Namespace) -> int:
    from kvshare.engine.config import kv_storage_dtype
    from kvshare.engine.presets import model_config_of
    from kvshare.errors import UserError
    from kvshare.preflight import check_model

    check_model(args.model)  # a mistyped path or preset named as every command names it
    try:
        config = model_config_of(args.model)
        dtype = kv_storage_dtype(args.kv_dtype, DTYPES[args.dtype] or config.dtype)  # as a replica runs it
        result = plan(config, args.tokens, args.chunk_tokens, dtype, args.high_watermark)
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from kvshare.units import format_bytes

    what = "attention layers" if "state_bytes" in result else "layers"
    print(
        f"{args.model}: {result['layers']} {what} x 2 (K,V) x {result['kv_heads']} KV heads x {result['head_dim']}"
        f" x {result['kv_dtype']} = {result['bytes_per_token']} bytes per token"
    )
    if "state_bytes" in result:
        _print_state(result)
    print(
        f"one {args.chunk_tokens}-token page: {format_bytes(result['page_bytes'])}"
        f" (the pool's --extent-size must be at least this)"
    )
    print(f"{args.tokens} cached tokens: {result['pages']} pages, {format_bytes(result['kv_bytes'])} of KV")
    print(f"pool size with eviction starting at {args.high_watermark:.0%}: --size {result['pool_size']}")
    return 0
