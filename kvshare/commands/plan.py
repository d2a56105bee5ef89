"""Size a pool: KV bytes per token of a model and the pool that holds N cached tokens; for a hybrid model (Gated
DeltaNet layers) also the bytes of its state at one position (a checkpoint)."""

from __future__ import annotations

import argparse
import dataclasses
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
    p.add_argument(
        "--state-checkpoint-chunks",
        type=int,
        default=None,
        metavar="M",
        help="a hybrid model: its replicas' --state-checkpoint-chunks (default: theirs), for the checkpoints' bytes",
    )
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


def plan(
    config, tokens: int, chunk_tokens: int, dtype: str | None, high_watermark: float, checkpoint_chunks: int = 0
) -> dict:
    """The pool for ``tokens`` cached tokens; a hybrid's with its state checkpoints, every ``checkpoint_chunks``
    chunks of them and one at their end (as one prompt's)."""
    from kvshare.layout import KVLayout
    from kvshare.units import format_bytes

    layout = KVLayout(config.num_kv_layers, config.num_kv_heads, config.head_dim, dtype or config.dtype, chunk_tokens)
    pages = -(-tokens // chunk_tokens)
    state = _state_plan(config)
    if state:
        chunks, every = tokens // chunk_tokens, checkpoint_chunks
        state["checkpoint_chunks"] = checkpoint_chunks
        state["checkpoints"] = chunks // every + bool(chunks % every) if every else 1  # the end's may be one of them
        state["checkpoint_bytes"] = state["checkpoints"] * state["state_bytes"]
    data = pages * layout.page_bytes
    pool = int((data + state.get("checkpoint_bytes", 0)) / high_watermark)
    return state | {
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
        # a page never straddles an extent, and a hybrid's state checkpoint is a page of its own
        "min_extent_size": format_bytes(max(layout.page_bytes, _state_plan(config).get("state_bytes", 0))),
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
    from kvshare.engine.config import DEFAULT_STATE_CHECKPOINT_CHUNKS, kv_storage_dtype
    from kvshare.engine.presets import model_config_of
    from kvshare.errors import UserError
    from kvshare.preflight import check_model

    check_model(args.model)  # a mistyped path or preset named as every command names it
    try:
        config = model_config_of(args.model)
        if DTYPES[args.dtype]:  # as a replica runs it: the KV's and a hybrid's conv state's dtype
            config = dataclasses.replace(config, dtype=DTYPES[args.dtype])
        dtype = kv_storage_dtype(args.kv_dtype, config.dtype)
        every = args.state_checkpoint_chunks
        every = DEFAULT_STATE_CHECKPOINT_CHUNKS if every is None else every
        result = plan(config, args.tokens, args.chunk_tokens, dtype, args.high_watermark, every)
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
            f"pool pages: one {args.chunk_tokens}-token KV page {format_bytes(result['page_bytes'])}, one state "
            f"checkpoint {format_bytes(result['state_bytes'])} (the pool's --extent-size must be at least "
            f"{result['min_extent_size']})"
        )
    else:
        print(
            f"one {args.chunk_tokens}-token page: {format_bytes(result['page_bytes'])}"
            f" (the pool's --extent-size must be at least this)"
        )
    print(f"{args.tokens} cached tokens: {result['pages']} pages, {format_bytes(result['kv_bytes'])} of KV")
    if "checkpoints" in result:
        print(
            f"and {result['checkpoints']} state checkpoints (every {result['checkpoint_chunks']} chunks and at the "
            f"end), {format_bytes(result['checkpoint_bytes'])}"
        )
    print(f"pool size with eviction starting at {args.high_watermark:.0%}: --size {result['pool_size']}")
    return 0
