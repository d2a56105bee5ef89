"""Run one prompt through the built-in engine and print the continuation (and where its KV came from)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvshare.commands.serve import DTYPES, add_deterministic_arguments, add_dtype_argument, add_kv_dtype_argument
from kvshare.units import parse_size_or_off

if TYPE_CHECKING:
    from kvshare.engine.engine import Engine
    from kvshare.engine.request import Provenance


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="a local HF model directory or a preset name (kvshare make-model --help lists them)",
    )
    p.add_argument("--pool", default="off", help="the pool's Unix socket, or 'off' (default)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_dtype_argument(p)
    add_kv_dtype_argument(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-file", help="file holding the prompt text ('-' for stdin)")
    prompt.add_argument("--prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to this mass"
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: a fresh one)")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens even past end-of-sequence")
    p.add_argument(
        "--chunk-tokens", type=int, default=256, help="tokens per shared chunk (must match the other replicas)"
    )
    p.add_argument(
        "--local-cache-size",
        type=parse_size_or_off,
        default="1GiB",
        help="local prefix cache bound (0 or off: no local cache)",
    )
    p.add_argument("--verify-checksums", action="store_true", help="verify every page loaded from the pool")
    p.add_argument("--tenant", default="", help="tenant salt of the key namespace")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    add_deterministic_arguments(p)


def run(args: argparse.Namespace) -> int:
    from kvshare.errors import UserError
    from kvshare.preflight import check_model

    check_model(args.model)
    text = _read_prompt(args)
    engine, load_s = _open_engine(args)
    tok = engine.tokenizer
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": text}]) if args.chat else tok.encode(text)
    try:
        generated = _generate(engine, prompt_ids, args)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    finally:
        engine.close()
    if not args.json:
        print(tok.decode(generated.token_ids)[len(generated.printed) :])
    else:
        print(_json_line(generated, tok.decode(generated.token_ids), len(prompt_ids), engine.layout.dtype, load_s))
    return 0


@dataclass
class _Generated:
    """One prompt's continuation, its timings from the first request, and the text already printed of it."""

    token_ids: list[int]
    first_token_s: float | None
    total_s: float
    finish_reason: str | None
    provenance: Provenance | None
    printed: str


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt's text: --prompt, or --prompt-file's contents ('-': stdin)."""
    import sys

    from kvshare.errors import UserError

    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise UserError(f"cannot read the prompt: {exc}") from None


def _open_engine(args: argparse.Namespace) -> tuple[Engine, float]:
    """The built-in engine of the flags and the seconds its model took to load (a UserError for a configuration
    it cannot run)."""
    import time

    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine
    from kvshare.errors import UserError

    started = time.perf_counter()
    try:
        engine = Engine(
            EngineConfig(
                model=args.model,
                device=args.device,
                dtype=DTYPES[args.dtype],
                kv_dtype=args.kv_dtype,
                pool_socket=None if args.pool == "off" else args.pool,
                chunk_tokens=args.chunk_tokens,
                local_cache_bytes=args.local_cache_size,
                verify_checksums=args.verify_checksums,
                deterministic=args.deterministic,
                grid_tokens=args.grid_tokens,
            )
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return engine, time.perf_counter() - started


def _generate(engine: Engine, prompt_ids: list[int], args: argparse.Namespace) -> _Generated:
    """Generate from the prompt; without --json, print the text as it comes (whole UTF-8 characters only)."""
    import time

    from kvshare.engine.engine import RequestOptions, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    started = time.perf_counter()
    token_ids, first_token_s, finish, provenance = [], None, None, None
    printed = ""
    for event in engine.generate(prompt_ids, params, RequestOptions(tenant=args.tenant)):
        if first_token_s is None:
            first_token_s = time.perf_counter() - started
        token_ids.append(event.token_id)
        finish, provenance = event.finish_reason, event.provenance
        text = engine.tokenizer.decode(token_ids)
        if not args.json and not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
            print(text[len(printed) :], end="", flush=True)
            printed = text
    total_s = time.perf_counter() - started
    return _Generated(token_ids, first_token_s, total_s, finish, provenance, printed)


def _json_line(generated: _Generated, text: str, num_prompt_tokens: int, kv_dtype: str, load_s: float) -> str:
    """--json's output: the continuation, where its prompt's KV came from, and the timings."""
    import json

    provenance = generated.provenance
    return json.dumps(
        {
            "text": text,
            "token_ids": generated.token_ids,
            "finish_reason": generated.finish_reason,
            "prompt_tokens": num_prompt_tokens,
            "provenance": {
                "local_tokens": provenance.local_tokens,
                "pool_tokens": provenance.pool_tokens,
                "computed_tokens": provenance.computed_tokens,
            },
            "deterministic": provenance.is_deterministic,
            "kv_dtype": kv_dtype,
            "model_load_s": round(load_s, 4),
            "ttft_s": round(generated.first_token_s, 4),
            "total_s": round(generated.total_s, 4),
        }
    )
