"""Write a synthetic preset (random weights, fixed seed) as an ordinary Hugging Face model directory."""

from __future__ import annotations

import argparse

PRESET_NAMES = ("tiny", "qwen3-8b", "qwen3-32b")  # kvshare.engine.presets.PRESETS (not imported here: torch)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("preset", choices=PRESET_NAMES, help="tiny (CPU), or qwen3-8b / qwen3-32b shapes (GPU, bf16)")
    p.add_argument("--out", required=True, help="directory to write (created if missing)")
    p.add_argument("--device", default="cpu",
                   help="where to build: the qwen3 presets draw their weights there (part of their identity); tiny always on the CPU")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"), help="default: the preset's")


def run(args: argparse.Namespace) -> int:
    import json

    from kvshare.engine.make_model import write_model_dir

    fingerprint = write_model_dir(args.preset, args.out, device=args.device, dtype=args.dtype)
    print(json.dumps({"preset": args.preset, "out": args.out, "weights_fingerprint": fingerprint}))
    return 0
