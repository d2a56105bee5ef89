"""Run one replica: the built-in engine behind an OpenAI-compatible HTTP server.

The flags ``vllm serve`` shares with it mean what they mean there: ``--served-model-name NAME [NAME ...]``
(default: ``--model`` as given), ``--max-model-len`` (``32k``/``32K``/``auto`` too) and ``--dtype``.
"""

from __future__ import annotations

import argparse
import re

from kvshare.commands import non_negative_int, tcp_port
from kvshare.units import parse_size, parse_size_or_off

# vLLM's --dtype values -> the engine's (None: the model's own dtype)
DTYPES = {
    "auto": None,
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
_MULTIPLIERS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}  # vLLM's human_readable_int


def parse_max_model_len(value: str) -> int | None:
    """vLLM's form: an integer, ``25.6k`` (x1000), ``32K`` (x1024), or ``auto``/``-1`` (the model's context)."""
    value = value.strip()
    if value.lower() == "auto" or value == "-1":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", value)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a token count such as 4096, 32k or 32K, or auto; got {value!r}")
    number, suffix = match.groups()
    if suffix:
        return int(float(number) * _MULTIPLIERS[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"a token count without a suffix is a whole number; got {value!r}")
    return int(number)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by serve, generate and up."""
    _add_model_arguments(p)
    _add_reuse_arguments(p)
    _add_execution_arguments(p)
    p.add_argument(
        "--max-model-len",
        type=parse_max_model_len,
        default=None,
        help="context length: prompt plus output tokens (as vLLM: 4096, 32k, 32K; default: the model's)",
    )
    add_dtype_argument(p)
    add_kv_dtype_argument(p)
    add_deterministic_arguments(p)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Which model the engine runs, on which device, under which identity."""
    p.add_argument("--model", default="tiny", help="a Hugging Face model directory or a preset name (default tiny)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--model-revision",
        default="",
        metavar="REVISION",
        help="name the model's identity yourself (e.g. a hub commit) instead of hashing its weights' "
        "bytes; replicas with one revision share KV, so it must name exactly these weights "
        "(default: hash them)",
    )


def _add_reuse_arguments(p: argparse.ArgumentParser) -> None:
    """Where the engine finds KV to reuse (pool, local cache, its own sequence), in which chunks, how checked."""
    p.add_argument("--pool", default=None, help="socket of a running pool, or 'off' (default: off)")
    p.add_argument(
        "--local-cache-size",
        type=parse_size_or_off,
        default="1GiB",
        help="local prefix cache size (0 or off: no local cache)",
    )
    p.add_argument(
        "--no-reuse-in-place",
        action="store_true",
        help="reuse only whole chunks (local cache, pool), not the last request's tokens still in the sequence KV",
    )
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per shared chunk")
    p.add_argument(
        "--state-checkpoint-chunks",
        type=non_negative_int,
        default=None,
        metavar="M",
        help="a hybrid model (Gated DeltaNet layers): keep its state every M chunks of a prompt, and at its last "
        "whole chunk, in the local cache and the pool (0: only there; default 64; docs/operations.md)",
    )
    p.add_argument(
        "--verify-rate",
        type=float,
        default=1.0,
        help="fraction of pool loads whose page checksums are verified (default 1: all)",
    )


def _add_execution_arguments(p: argparse.ArgumentParser) -> None:
    """How the engine copies and computes on its device: staging buffers, CUDA graphs, attention."""
    p.add_argument(
        "--staging-buffers",
        type=int,
        default=2,
        help="CUDA: GPU staging buffers (256 MiB each) a pool load or store rotates through; more lets "
        "the copies run further ahead of the scatters when compute shares the GPU (default 2)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs (as vllm serve's flag)",
    )
    from kvshare.engine.config import ATTENTION_CHOICES

    p.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default="auto",
        help="prefill attention: auto = FlashAttention's varlen kernel (vLLM's vllm_flash_attn or "
        "flash_attn) on CUDA in bf16/fp16 where one loads, else SDPA; flash = that or an error; "
        "sdpa = SDPA (the deterministic mode runs the kernel per grid chunk where its start-up self-test finds "
        "it exact, else SDPA)",
    )


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    """The dtype a model runs in, with vLLM's names (serve, generate, plan): one meaning wherever it is taken."""
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default="auto",
        help="the dtype the model runs in: its weights and, unless --kv-dtype, its KV (vLLM's names; "
        "default auto: the model's own)",
    )


def add_kv_dtype_argument(p: argparse.ArgumentParser) -> None:
    """The built-in engine's KV dtype (serve, generate, up, bench)."""
    from kvshare.engine.config import KV_DTYPE_CHOICES

    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPE_CHOICES,
        default="auto",
        help="the KV cache's dtype, so the pool pages' (default auto: the model's); "
        "fp8 is float8_e4m3fn with scale 1.0, half of bf16's bytes",
    )


def add_deterministic_arguments(p: argparse.ArgumentParser) -> None:
    """The built-in engine's deterministic mode (serve, generate)."""
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="chunk-invariant prefill: reuse gives the same bits as recomputing (ids and logprobs), and "
        "the audit demands exact equality; slower cold prefill (docs/validate.md)",
    )
    p.add_argument(
        "--grid-tokens",
        type=int,
        default=None,
        help="with --deterministic: tokens per prefill grid chunk, a multiple of --chunk-tokens (default: 2048 on "
        "CUDA, where smaller grid chunks are launch-bound; --chunk-tokens on CPU); reuse is rounded down to it",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    _add_listen_arguments(p)
    _add_limit_arguments(p)
    _add_access_arguments(p)
    p.add_argument(
        "--max-tokenize-size",
        type=parse_size,
        default="1MiB",
        help="largest /tokenize or /detokenize body (larger: 413)",
    )
    _add_audit_arguments(p)
    p.add_argument(
        "--write-timeout",
        type=float,
        default=30.0,
        help="seconds a streaming client may take to accept one write before it is dropped",
    )
    p.add_argument("--instance-id", default="", help="an id /health reports (kvshare up checks it is its child)")
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="publish the local prefix cache's KV events here (tcp://*:PORT or ipc://PATH), in vLLM's "
        "format with medium GPU, on topic kv@<replica name>@<model>; pool_aware routers read them "
        "with --replica-kv-events",
    )
    _add_token_cache_arguments(p)
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="report healthy at once, without the warm-up (a tiny prefill, pool store and pool load in a "
        "private namespace) that takes the one-time costs out of the first request's TTFT",
    )


def _add_listen_arguments(p: argparse.ArgumentParser) -> None:
    """Where the replica listens and the names it answers with."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=tcp_port, default=8000, help="port to listen on")
    p.add_argument("--replica-name", default=None, help="name reported in responses (default host:port)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model ids requests may name; the first is reported in responses (default: --model as given)",
    )


def _add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """What the replica refuses: a full queue, long prompts, large outputs and bodies."""
    p.add_argument("--max-requests", type=int, default=64, help="queued + running requests before 429")
    p.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="refuse longer prompts (default: the model's context)"
    )
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="refuse a larger max_tokens / max_completion_tokens (default: none; the context bounds it, as in vLLM)",
    )
    p.add_argument("--max-body-size", type=parse_size, default="16MiB", help="refuse larger request bodies (413)")


def _add_access_arguments(p: argparse.ArgumentParser) -> None:
    """Who may use the replica, how tenants' KV is kept apart, and what a response tells of its reuse."""
    p.add_argument("--api-key", action="append", default=[], help="require this bearer token (repeatable)")
    p.add_argument(
        "--tenant-header",
        default="",
        help="header whose value salts the pool namespace per tenant "
        "(with --api-key it splits a key's namespace further; docs/reliability.md)",
    )
    p.add_argument(
        "--provenance",
        choices=("off", "own-tenant", "all"),
        default="own-tenant",
        help="who gets the kvshare object (local/pool/computed tokens) and cached_tokens: all; only "
        "requests with a namespace of their own (a tenant or a cache_salt; the default); or nobody. "
        "For requests that share a namespace it says what others asked (docs/operations.md)",
    )


def _add_audit_arguments(p: argparse.ArgumentParser) -> None:
    """Audits: requests served with reused KV, recomputed cold and compared."""
    p.add_argument(
        "--audit-rate",
        type=float,
        default=0.0,
        help="share of requests served with reused KV that are recomputed cold when idle and compared "
        "(a mismatch is counted, logged, and its chunks dropped; default 0: off)",
    )
    p.add_argument("--audit-tokens", type=int, default=8, help="generated tokens an audit compares (default 8)")
    p.add_argument(
        "--audit-gap-threshold",
        type=float,
        default=1e-3,
        help="an audit tolerates a divergence at a step whose top-2 logprob gap is below this",
    )


def _add_token_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The token ids of long prompts, shared with the user's other replicas."""
    p.add_argument(
        "--token-cache-dir",
        default=None,
        metavar="DIR",
        help="share long prompts' token ids with the other replicas of this user that name DIR (a private "
        "directory, created 0700; kvshare up passes its own; 'off' or no flag: this replica's only)",
    )
    p.add_argument(
        "--token-cache-size",
        type=parse_size,
        default="256MiB",
        help="bytes of token ids kept in --token-cache-dir, least recently used out (default 256MiB)",
    )


def engine_config(args: argparse.Namespace):
    from kvshare.engine.engine import EngineConfig

    pool = None if args.pool in (None, "off") else args.pool
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=DTYPES[args.dtype],
        kv_dtype=args.kv_dtype,
        pool_socket=pool,
        local_cache_bytes=args.local_cache_size,
        reuse_in_place=not args.no_reuse_in_place,
        chunk_tokens=args.chunk_tokens,
        **({} if args.state_checkpoint_chunks is None else {"state_checkpoint_chunks": args.state_checkpoint_chunks}),
        max_model_len=args.max_model_len,
        verify_checksums=args.verify_rate >= 1.0,
        verify_fraction=min(args.verify_rate, 1.0),
        deterministic=args.deterministic,
        grid_tokens=args.grid_tokens,
        staging_buffers=args.staging_buffers,
        enforce_eager=args.enforce_eager,
        model_revision=args.model_revision,
        attention=args.attention,
        kv_events=_kv_events_config(args),
    )


def _kv_events_config(args: argparse.Namespace):
    """serve --kv-events: the local prefix cache's publisher (None without it)."""
    import os

    from kvshare.pool.event_publisher import KVEventsConfig

    if not args.kv_events:
        return None
    name = args.replica_name or f"{args.host}:{args.port}"
    topic = f"kv@{name}@{os.path.basename(os.path.normpath(args.model))}"
    return KVEventsConfig(endpoint=args.kv_events, topics=(topic,), block_size=args.chunk_tokens)


def serve_config(args: argparse.Namespace):
    from kvshare.serve.audit import AuditConfig
    from kvshare.serve.config import ServeConfig

    return ServeConfig(
        host=args.host,
        port=args.port,
        replica_name=args.replica_name or f"{args.host}:{args.port}",
        served_model_names=tuple(args.served_model_name or ()),
        max_body_bytes=args.max_body_size,
        max_requests=args.max_requests,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        api_keys=tuple(args.api_key),
        tenant_header=args.tenant_header,
        write_timeout_s=args.write_timeout,
        instance_id=args.instance_id,
        warmup=args.warmup,
        provenance=args.provenance,
        max_tokenize_bytes=args.max_tokenize_size,
        audit=AuditConfig(rate=args.audit_rate, num_tokens=args.audit_tokens, gap_threshold=args.audit_gap_threshold),
    )


def build_engine(args: argparse.Namespace):
    from kvshare.engine.engine import Engine
    from kvshare.engine.token_share import SharedPieces, TokenShareConfig

    shared = None  # the directory is checked before the model loads
    if args.token_cache_dir not in (None, "off"):
        shared = SharedPieces(TokenShareConfig(args.token_cache_dir, args.token_cache_size))
    engine = Engine(engine_config(args))
    engine.tokenizer.share_pieces(shared)
    return engine


def provenance_note(config) -> str | None:
    """The line a replica adds to its ready line where its default withholds every request's provenance (no
    tenants: all requests share one namespace, so only a request with a cache_salt has one of its own)."""
    if config.provenance != "own-tenant" or config.api_keys or config.tenant_header:
        return None
    return (
        "provenance (the kvshare object, usage.prompt_tokens_details) is shown only to requests with a cache_salt: "
        "this replica has no tenants (--provenance own-tenant); one user's replica: --provenance all"
    )


def run(args: argparse.Namespace) -> int:
    import os
    import signal

    from aiohttp import web

    from kvshare.errors import UserError
    from kvshare.heap import freeze_startup_heap
    from kvshare.preflight import check_model, check_ports_free
    from kvshare.serve.server import ReplicaServer

    check_model(args.model)
    try:
        config = serve_config(args)
        check_ports_free(config.host, {config.port: "this replica"})  # before the model loads
        engine = build_engine(args)
        server = ReplicaServer(engine, config)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    ready = f"kvshare replica ready: http://{config.host}:{config.port} model={server.served.name}"
    if engine.device.type == "cuda":  # which prefill attention kernel runs (kvshare.engine.flash)
        ready += f" attention={engine.attention.name}"
        ready += f" elementwise={'eager' if engine.fused.kernels is None else engine.fused.kernels.name}"
    if engine.grid is not None:  # its pages are shared only with replicas of the same grid and kernel build
        ready += f" deterministic (grid {engine.grid.grid_tokens}, kernels {engine.grid.kernel_build})"
    # the ready line once it listens and has warmed up (/health answers 503 "warming up" meanwhile);
    # a failed warm-up stops the replica (SIGTERM: run_app's clean shutdown) and exits 2
    note = provenance_note(config)
    server.readiness.on_ready = lambda: print(ready + (f"\n{note}" if note else ""), flush=True)
    server.readiness.on_failed = lambda exc: os.kill(os.getpid(), signal.SIGTERM)
    freeze_startup_heap()  # the collector never walks the startup heap again (kvshare.heap)
    try:
        web.run_app(
            server.app(),
            host=config.host,
            port=config.port,
            print=lambda _: server.readiness.listening(),
            access_log=None,
        )
    except OSError as exc:  # the port was taken while the model loaded
        raise UserError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    if server.readiness.error:
        raise UserError(f"the replica's warm-up failed ({server.readiness.error}); --no-warmup skips it")
    return 0
