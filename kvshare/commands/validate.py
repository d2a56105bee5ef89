"""Validate this machine and deployment in layers: bytes, helpers, full pool, service; a pass/fail table.

Levels (--level, comma list; default all):
  bytes      random KV through every transfer path here (CPU; CUDA over the registered arena, with the
             delay-injection ordering checks and their deliberately unordered controls), byte for byte
  helpers    every engine KV layout <-> canonical page conversion against its slow reference; model identity:
             one changed weight (equal config and headers) gives another namespace, a renamed copy the same
  full-pool  every page of the pool allocated, written with a per-page pattern and verified
  service    pool ON == pool OFF responses (temperature 0) on live replicas, with provenance
  isolation  two tenants, one prompt, on a cluster it starts (tenant header, --provenance own-tenant,
             cache_aware router): no shared pages, no routing signal, no provenance signal (not in the default)
Exit status 0 when no level failed; levels that need hardware this machine lacks are skipped, not passed.
"""

from __future__ import annotations

import argparse

from kvshare.commands import RawDescriptionDefaultsHelpFormatter
from kvshare.units import parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = RawDescriptionDefaultsHelpFormatter
    p.add_argument(
        "--level",
        default="bytes,helpers,full-pool,service",
        help="comma list of levels: bytes, helpers, full-pool, service, isolation (default: all but isolation)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda when a GPU is seen), cpu, cuda or cuda:N")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the full report as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("pool (bytes and full-pool levels)")
    g.add_argument(
        "--pool",
        default=None,
        metavar="SOCKET",
        help="validate this running pool (default: start one of --pool-size, removed at exit)",
    )
    g.add_argument(
        "--pool-size", type=parse_size, default="4GiB", help="size of the pool validate starts (default 4GiB)"
    )
    g.add_argument(
        "--extent-size",
        type=parse_size,
        default="256MiB",
        help="allocation and CUDA registration unit of that pool (default 256MiB)",
    )
    g.add_argument(
        "--page-size", type=parse_size, default="2MiB", help="page size of the full-pool level (default 2MiB)"
    )
    g.add_argument("--threads", type=int, default=None, help="threads of the full-pool level (default min(8, cores))")
    s = p.add_argument_group("service level")
    s.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="a live replica (repeatable; two or more for cross-replica reuse). "
        "Default: start a cluster (kvshare up) of --service-replicas replicas of --model",
    )
    s.add_argument("--model", default="tiny", help="model of the cluster validate starts (default tiny)")
    s.add_argument("--service-replicas", type=int, default=2, help="replicas of the cluster validate starts")
    s.add_argument("--service-pool-size", default="1GiB", help="pool of the cluster validate starts")
    s.add_argument("--replica-arg", action="append", default=[], help="extra argument for every replica it starts")
    s.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    s.add_argument("--chunk-tokens", type=int, default=256, help="the replicas' chunk size (default 256)")
    s.add_argument(
        "--prompt-lengths",
        default="256,300,512,777,1024,1300",
        help="token lengths of the completion prompts (default 256,300,512,777,1024,1300)",
    )
    s.add_argument("--chat-prompts", type=int, default=2, help="chat prompts (default 2)")
    s.add_argument(
        "--gap-threshold",
        type=float,
        default=1e-3,
        help="a divergence is tolerated only at a step whose top-2 logprob gap is below this (default 1e-3)",
    )
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--seed", type=int, default=None, help="fix the prompt set (default: a fresh nonce per run)")


def config_from_args(args: argparse.Namespace):
    from kvshare.validate.runner import ValidateConfig

    if args.pool == "off":
        raise ValueError("--pool off: the bytes and full-pool levels need a pool (leave --pool out to start one)")
    levels = tuple(lv.strip() for lv in args.level.split(",") if lv.strip())
    return ValidateConfig(
        levels=levels,
        device=args.device,
        pool=args.pool,
        pool_size=args.pool_size,
        extent_size=args.extent_size,
        page_size=args.page_size,
        threads=args.threads,
        progress=not args.no_progress,
        replicas=tuple(args.replica),
        model=args.model,
        num_replicas=args.service_replicas,
        service_pool_size=args.service_pool_size,
        replica_args=tuple(args.replica_arg),
        max_tokens=args.max_tokens,
        chunk_tokens=args.chunk_tokens,
        prompt_lengths=tuple(int(n) for n in args.prompt_lengths.split(",") if n.strip()),
        num_chat=args.chat_prompts,
        gap_threshold=args.gap_threshold,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvshare.errors import UserError
    from kvshare.validate.runner import run_validate

    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    console = Console()
    report = run_validate(config, console)
    report.render(console)
    if args.json_path:
        report.write_json(args.json_path)
        console.print(f"report written to {args.json_path}")
    return report.exit_code
