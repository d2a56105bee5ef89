"""`kvshare bench routing`: sessions over shared system prompts through a router per placement policy
(kvshare.bench.routing), on a cluster it starts; token counts scale with --scale."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from kvshare.units import parse_count

if TYPE_CHECKING:
    from kvshare.bench.routing_trace import RoutingConfig


def _token_range(text: str) -> tuple[int, int]:
    """'4000-6000' or '4k-6k' -> (4000, 6000); one count gives a range of one."""
    low, _, high = str(text).partition("-")
    try:
        values = parse_count(low), parse_count(high or low)
    except ValueError:
        values = (0, 0)
    if min(values) < 1 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected a token range LOW-HIGH, got {text!r} (example: 4000-6000)")
    return values


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in str(text).split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r} (example: 0.5,1,2,4)") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError("arrival rates are sessions per second above 0")
    return rates


def _run_index(text: str) -> int:
    try:
        index = int(text)
    except ValueError:
        index = -1
    if index < 0:
        raise argparse.ArgumentTypeError(f"a run number is a whole number >= 0, got {text!r}")
    return index


def add_routing_arguments(sub, words) -> None:
    """The `bench routing` subcommand's flags, on the `bench` subparsers."""
    from kvshare.bench.routing_trace import CONTROLS, DEFAULT_CONDITIONS, RoutingConfig

    d = RoutingConfig()
    e = sub.add_parser(
        "routing",
        help="sessions over shared system prompts through every policy's router",
        description="Many multi-turn sessions over a few shared system prompts, Poisson arrivals "
        "swept over --rates, replayed through a router per placement policy on one "
        "cluster it starts (pool with KV events, replicas whose local cache holds "
        "1/--gpu-share of the working set). Token counts are multiplied by --scale.",
    )
    _add_cluster_arguments(e.add_argument_group("cluster"))
    w = e.add_argument_group("workload")
    _add_trace_arguments(w, d)
    w.add_argument(
        "--conditions",
        type=words,
        default=DEFAULT_CONDITIONS + CONTROLS,
        help=f"comma list of POLICY/on|off|hints (hints: the pool on, and the router sends the vLLM replicas "
        f"prefetch hints) and controls ({', '.join(CONTROLS)})",
    )
    _add_replay_arguments(w, d)


def _add_cluster_arguments(g: argparse._ArgumentGroup) -> None:
    """The cluster each replay starts: its model, device, replicas and engine, and extra arguments for them."""
    g.add_argument("--model", help="model directory or preset of the replicas it starts (required to run)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or one per replica as a comma list")
    g.add_argument("--replicas", type=int, default=2, help="replicas of each cluster it starts")
    g.add_argument(
        "--engine",
        choices=("builtin", "vllm"),
        default="builtin",
        help="what the replicas run (as kvshare up --engine): vllm sizes vLLM's KV cache by --gpu-share and has "
        "the pool_aware routers read each replica's own KV events",
    )
    g.add_argument(
        "--vllm-python", default=None, help="--engine vllm: python of the virtual environment that holds vLLM"
    )
    g.add_argument("--replica-arg", action="append", default=[], help="extra argument for every replica (repeatable)")
    g.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="extra argument for every router (repeatable), e.g. pool_aware's --router-arg=--prefill-rate=2500",
    )
    g.add_argument("--tokenizer", default=None, help="model directory or preset whose tokenizer builds the prompts")


def _add_trace_arguments(w: argparse._ArgumentGroup, d: RoutingConfig) -> None:
    """The trace: sessions, shared prompts and turns, their token ranges, and the arrival rates swept."""
    w.add_argument("--sessions", type=int, default=d.num_sessions, help="sessions per replay")
    w.add_argument("--prompts", type=int, default=d.num_prompts, help="shared system prompts")
    w.add_argument("--turns", type=int, default=d.num_turns, help="turns per session")
    w.add_argument("--system-tokens", type=_token_range, default=d.system_tokens, help="range, e.g. 4000-6000")
    w.add_argument("--user-tokens", type=_token_range, default=d.user_tokens, help="range, e.g. 200-1200")
    w.add_argument("--answer-tokens", type=_token_range, default=d.answer_tokens, help="range, e.g. 100-300")
    w.add_argument("--scale", type=float, default=1.0, help="multiplies every token range (0.1: a CPU-sized run)")
    w.add_argument("--rates", type=_rates, default=d.rates, help="session arrivals per second, e.g. 0.5,1,2,4")


def _add_replay_arguments(w: argparse._ArgumentGroup, d: RoutingConfig) -> None:
    """How the trace is replayed: runs, cache sizes, verification, seed, timeout, and where results go."""
    w.add_argument("--runs", type=int, default=d.num_runs, help="the whole sweep this many times, on fresh clusters")
    w.add_argument(
        "--gpu-share", type=float, default=d.gpu_share, help="the working set over one replica's local (GPU) KV cache"
    )
    w.add_argument("--pool-share", type=float, default=d.pool_share, help="the pool's size over the working set")
    w.add_argument(
        "--verify",
        type=int,
        default=d.num_verify,
        help="last turns per replay re-sent with every cache off (vLLM: the pool off and a cache_salt of their "
        "own) and compared with the measured outputs by the gap rule (docs/validate.md)",
    )
    w.add_argument("--seed", type=int, default=d.seed, help="seed of the trace (the same seed: the same sessions)")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    w.add_argument(
        "--out",
        default="results/routing",
        help="results folder: records appended, the report rebuilt from every invocation's runs in it",
    )
    w.add_argument(
        "--run-index",
        type=_run_index,
        default=None,
        help="number of this invocation's first run (default: after the last in --out); the number picks the "
        "condition order, and a run number given again replaces that run's replays",
    )
    w.add_argument(
        "--summarize",
        metavar="OUT",
        default=None,
        help="replay nothing: rebuild OUT's summary.json and routing.md from its routing.jsonl and print the table",
    )


def routing_plan(args: argparse.Namespace):
    """(RoutingConfig, RoutingTarget) of the parsed flags: the trace and the cluster it is replayed on, sized from
    the trace's working set; ValueError for flags that do not make one."""
    from kvshare.bench.routing import kv_bytes_per_token
    from kvshare.bench.routing_cluster import RoutingTarget
    from kvshare.bench.routing_trace import RoutingConfig, make_trace, scaled

    if args.scale <= 0:
        raise ValueError("--scale must be above 0")
    config = RoutingConfig(
        num_sessions=args.sessions,
        num_prompts=args.prompts,
        num_turns=args.turns,
        system_tokens=scaled(args.system_tokens, args.scale),
        user_tokens=scaled(args.user_tokens, args.scale),
        answer_tokens=scaled(args.answer_tokens, args.scale),
        rates=args.rates,
        conditions=args.conditions,
        num_runs=args.runs,
        gpu_share=args.gpu_share,
        pool_share=args.pool_share,
        num_verify=args.verify,
        seed=args.seed,
    )
    per_token = kv_bytes_per_token(args.model)
    trace = make_trace(config)
    working_set = trace.working_set_tokens() * per_token
    target = RoutingTarget(
        model=args.model,
        device=args.device,
        num_replicas=args.replicas,
        engine=args.engine,
        vllm_python=args.vllm_python,
        max_model_len=vllm_max_model_len(trace) if args.engine == "vllm" else None,
        local_cache_bytes=int(working_set / config.gpu_share),
        pool_bytes=max(int(working_set * config.pool_share), 64 << 20),
        kv_bytes_per_token=per_token,
        replica_args=tuple(args.replica_arg),
        router_args=tuple(args.router_arg),
    )
    return config, target


def vllm_max_model_len(trace) -> int:
    """vLLM replicas' --max-model-len for ``trace``: its longest request, with room for what the prompts add to
    the counted tokens (each prompt's tag, ~100 tokens, and the chat template's ~10 a message; a reply re-encoded
    in the history may take more tokens than were generated), in whole 256-token chunks."""
    num_messages = 1 + 2 * max(len(s.user_tokens) for s in trace.sessions)
    room = trace.longest_request_tokens() * 1.1 + 128 + 16 * num_messages
    return -(-int(room) // 256) * 256


def run_routing(args: argparse.Namespace) -> int:
    import shlex
    import sys

    from rich.console import Console

    from kvshare.bench.routing import run_routing as run
    from kvshare.commands import sigterm_as_interrupt
    from kvshare.errors import UserError

    console = Console()
    if args.summarize is not None:
        return _summarize(args.summarize, console)
    if not args.model:
        raise UserError("give --model (the replicas' model), or --summarize OUT to rebuild a results folder's report")
    try:
        config, target = routing_plan(args)
    except ValueError as exc:
        raise UserError(str(exc)) from None

    def show(row: dict) -> None:
        console.print(
            f"{time.strftime('%H:%M:%S')} rate {row['rate']:g} {row['condition']} run {row['run']}: "
            f"{row['num_requests']} requests, {row['num_errors']} failed, {row['wall_s']:.1f} s",
            highlight=False,
        )

    command = "kvshare " + shlex.join(sys.argv[1:])
    try:
        with sigterm_as_interrupt():  # `timeout`: the cluster stops in order; the report holds every replay done
            summary, path = run(config, target, args.out, command, args.tokenizer, args.timeout, show, args.run_index)
    except (RuntimeError, TimeoutError, ValueError) as exc:  # a cluster that does not start, another workload's --out
        raise UserError(f"{type(exc).__name__}: {exc}") from None
    return _show(summary, path, console)


def _summarize(out: str, console) -> int:
    """--summarize OUT: the report rebuilt from the folder's rows, nothing replayed."""
    import os

    from kvshare.bench.records import ResultsDir
    from kvshare.bench.routing_results import ROWS, write_summary
    from kvshare.errors import UserError

    if not os.path.isfile(os.path.join(out, ROWS)):
        raise UserError(f"{out} holds no {ROWS}: not a results folder of kvshare bench routing")
    summary, path = write_summary(ResultsDir(out))
    return _show(summary, path, console)


def _show(summary: list[dict], path: str, console) -> int:
    from kvshare.bench.report import Table, print_tables
    from kvshare.bench.routing_summary import HEADERS, highest_complete_rate, table_rows

    print_tables([Table("kvshare bench routing", HEADERS, tuple(table_rows(summary)), "")], console)
    rate = highest_complete_rate(summary)
    console.print(f"every condition completed every request up to: {'none' if rate is None else f'{rate:g}/s'}")
    console.print(f"report: {path}")
    return 0 if rate is not None else 3
