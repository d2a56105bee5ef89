"""Write a synthetic preset (random weights, fixed seed) as an ordinary Hugging Face model directory.

The qwen3 and qwen3.5 presets but qwen3.5-tiny are GPU shapes (16 to 65 GB of weights): on a machine without a GPU
``make-model`` asks before it writes one (``--yes`` answers for it; without a terminal it
refuses unless ``--yes`` is given).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from kvshare.preflight import PRESET_NAMES  # kvshare.engine.presets.PRESETS (not imported here: torch)

CONFIRM_ABOVE_BYTES = 1 << 30  # larger presets are meant for a GPU


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "preset",
        choices=PRESET_NAMES,
        help="tiny or qwen3.5-tiny (CPU), or the qwen3-8b / qwen3-32b / qwen3.5-9b / qwen3.5-27b shapes (GPU, bf16)",
    )
    p.add_argument("--out", required=True, help="directory to write (created if missing)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where to build: the GPU presets draw their weights there (part of their identity); "
        "the tiny ones always on the CPU",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="the dtype its weights are written in, which a replica runs it in (default: the preset's own)",
    )
    p.add_argument("--yes", action="store_true", help="write a GPU preset on a machine without a GPU without asking")
    p.add_argument(
        "--no-weights",
        action="store_true",
        help="write the config and tokenizer only, for an engine that draws its own random weights "
        "(vLLM --load-format dummy); such a directory has no weights fingerprint",
    )


def confirm_large_write(
    preset: str, num_bytes: int, out: str, has_gpu: bool, is_yes: bool, is_tty: bool, ask: Callable[[str], str] = input
) -> None:
    """Raise UserError unless writing ``num_bytes`` of ``preset`` is wanted: small, a GPU here, --yes, or a 'y'."""
    from kvshare.errors import UserError
    from kvshare.units import format_bytes

    if num_bytes <= CONFIRM_ABOVE_BYTES or has_gpu or is_yes:
        return
    what = f"preset {preset} is a GPU model: {format_bytes(num_bytes)} of weights to {out}, and this machine has no GPU"
    if not is_tty:
        raise UserError(f"{what}; pass --yes to write it anyway")
    if ask(f"{what}. Write it? [y/N] ").strip().lower() not in ("y", "yes"):
        raise UserError("nothing written")


def run(args: argparse.Namespace) -> int:
    import json

    import torch

    from kvshare.engine.make_model import preset_weight_bytes, write_model_dir, write_model_files
    from kvshare.errors import UserError

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"--out {args.out} is a file; name a directory to write the model into")
    if args.no_weights:
        write_model_files(args.preset, args.out, args.dtype)
        print(json.dumps({"preset": args.preset, "out": args.out, "weights_fingerprint": None}))
        return 0
    confirm_large_write(
        args.preset,
        preset_weight_bytes(args.preset, args.dtype),
        args.out,
        has_gpu=torch.cuda.is_available(),
        is_yes=args.yes,
        is_tty=sys.stdin.isatty(),
    )
    try:
        fingerprint = write_model_dir(args.preset, args.out, device=args.device, dtype=args.dtype)
    except OSError as exc:  # a directory we may not write, a full disk
        raise UserError(f"cannot write {args.out}: {exc.strerror or exc}") from None
    print(json.dumps({"preset": args.preset, "out": args.out, "weights_fingerprint": fingerprint}))
    return 0
