"""Benchmarks: the pool's data and control planes (pool) and a replica's read of a token-id prompt (parse), and
the study's experiments: ttft (cold, local and cross-replica reuse), blocks
(OFF-ON-ON-OFF, paired, bootstrap intervals), sessions (alternate vs sticky placement, pool off vs on), suite
(several in one run), routing (many sessions over shared system prompts at swept arrival rates, through every
placement policy's router) and report.
They talk HTTP to OpenAI-compatible servers (--replica URL, e.g. a kvshare cluster or vLLM
servers) or start their own (--model M); results are appended to --out and a rerun of the
same command skips what was measured. Context lengths take k = 1000 tokens (128k = 128000)."""

from __future__ import annotations

import argparse

from kvshare.commands import sigterm_as_interrupt, tcp_port
from kvshare.commands.bench_micro import add_micro_arguments, run_parse, run_pool
from kvshare.commands.bench_routing import add_routing_arguments, run_routing
from kvshare.commands.serve import add_kv_dtype_argument
from kvshare.units import parse_counts

EXPERIMENT_NAMES = ("ttft", "blocks", "sessions")


def parse_tokens(text: str) -> tuple[int, ...]:
    """Context lengths: '512,8k,32K' -> (512, 8000, 32768) (kvshare.units.parse_counts)."""
    try:
        return parse_counts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _router(text: str) -> tuple[str, str]:
    placement, sep, url = text.partition("=")
    if not sep or placement not in ("alternate", "sticky") or not url:
        raise argparse.ArgumentTypeError(f"expected alternate=URL or sticky=URL, got {text!r}")
    return placement, url


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="experiment", required=True)
    add_micro_arguments(sub, parse_tokens)
    helps = {
        "ttft": "TTFT cold / local reuse / cross-replica reuse by context length",
        "blocks": "the blocked OFF-ON-ON-OFF design: cross-replica TTFT, paired, bootstrap CIs",
        "sessions": "multi-turn sessions: alternate vs sticky placement, pool off vs on",
        "suite": "several experiments in one run (--experiments), sharing the replicas",
    }
    for name, help_text in helps.items():
        e = sub.add_parser(name, help=help_text, description=help_text)
        _target_arguments(e)
        _run_arguments(e)
        if name == "suite":
            e.add_argument(
                "--experiments", type=_words, default=EXPERIMENT_NAMES, help="comma list of ttft,blocks,sessions"
            )
        if name in ("ttft", "suite"):
            _ttft_arguments(e)
        if name in ("blocks", "suite"):
            _blocks_arguments(e)
        if name in ("sessions", "suite"):
            _sessions_arguments(e)
    add_routing_arguments(sub, _words)
    _add_report_parser(sub)


def _ttft_arguments(e: argparse.ArgumentParser) -> None:
    """ttft's own flags: prompts per context and how they are sent."""
    e.add_argument("--repetitions", type=int, default=3, help="ttft: prompts per context length")
    e.add_argument(
        "--client",
        choices=("token_ids", "text"),
        default="token_ids",
        help="ttft: token_ids (prompt ids to /v1/completions) or text (chat text through a user's "
        "client, the openai SDK where installed; each paired with its ids: text_overhead)",
    )


def _blocks_arguments(e: argparse.ArgumentParser) -> None:
    """blocks' own flags: the block design and how its prompts are primed."""
    e.add_argument("--per-block", type=int, default=8, help="blocks: requests per block")
    e.add_argument(
        "--prime-batch",
        type=int,
        default=None,
        help="blocks: primes sent before their measurements, where the pool cannot hold a whole "
        "block's (default: the whole block)",
    )
    e.add_argument("--design", type=_words, default=("off", "on", "on", "off"), help="blocks: block order")
    e.add_argument("--prime-off", action="store_true", help="blocks: prime OFF prompts on replica A too")


def _sessions_arguments(e: argparse.ArgumentParser) -> None:
    """sessions' own flags: the sessions' shape and the placements and pool conditions compared."""
    e.add_argument(
        "--session-contexts",
        type=parse_tokens,
        default=None,
        help="sessions: initial contexts (default: --contexts)",
    )
    e.add_argument("--sessions", type=int, default=2, help="sessions per context, placement and pool")
    e.add_argument("--turns", type=int, default=6, help="sessions: turns per session")
    e.add_argument("--turn-tokens", type=int, default=256, help="new user tokens per turn")
    e.add_argument("--answer-tokens", type=int, default=32, help="generated tokens per turn")
    e.add_argument(
        "--placements",
        type=_words,
        default=("alternate", "sticky"),
        help="sessions: placements compared (alternate: turn k on replica k mod N; sticky: one replica)",
    )
    e.add_argument("--pools", type=_words, default=("off", "on"), help="sessions: pool conditions compared")
    e.add_argument(
        "--router",
        type=_router,
        action="append",
        default=[],
        help="send a placement's turns through a router: alternate=URL or sticky=URL "
        "(default: place turns directly, with the router's own policy code)",
    )


def _add_report_parser(sub) -> None:
    """bench report: rewrite a results folder's report."""
    report = sub.add_parser("report", help="rewrite report.md, records.csv and plots of a results folder")
    report.add_argument("--out", default="results/bench", help="the results folder")
    report.add_argument("--compact", action="store_true", help="print headline lines instead of the tables")


def _target_arguments(e: argparse.ArgumentParser) -> None:
    g = e.add_argument_group("where to send requests")
    g.add_argument("--replica", action="append", default=[], help="URL of a running replica (repeat; A first, then B)")
    g.add_argument(
        "--off-replica",
        action="append",
        default=[],
        help="URL of a replica without a pool: pool-OFF requests go there, without the request extension",
    )
    g.add_argument(
        "--no-extension",
        action="store_true",
        help="never send the kvshare request extension (servers that reject unknown fields)",
    )
    g.add_argument(
        "--timeline",
        action="store_true",
        help="ask kvshare replicas for each request's timeline (where its time went, to the first token "
        "and the prompt's store after it); records.jsonl keeps it",
    )
    g.add_argument("--model", default=None, help="start replicas of this model (directory or preset) instead")
    g.add_argument(
        "--device", default="cpu", help="with --model: cpu, cuda, cuda:N, or one per replica as a comma list, cycled"
    )
    g.add_argument("--replicas", type=int, default=2, help="replicas to start with --model")
    g.add_argument("--pool-size", default="4GiB", help="size of the pool started with --model")
    g.add_argument("--pool-arg", action="append", default=[], help="extra argument for that pool (repeatable)")
    g.add_argument(
        "--replica-arg",
        action="append",
        default=[],
        help="extra argument for every started replica (repeatable), e.g. --replica-arg=--local-cache-size=20GiB",
    )
    g.add_argument(
        "--sequential",
        action="store_true",
        help="with --model: start the replicas one at a time against one pool (a model that fits once)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="with --model: start the replicas in the deterministic mode (serve --deterministic); "
        "outputs of deterministic replicas are checked by the exact rule",
    )
    add_kv_dtype_argument(g)
    g.add_argument("--port", type=tcp_port, default=None, help="first port for started processes (default: free ports)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="model directory or preset whose tokenizer builds the prompts "
        "(default: --model, else the served model's name)",
    )


def _run_arguments(e: argparse.ArgumentParser) -> None:
    g = e.add_argument_group("run")
    g.add_argument("--out", default="results/bench", help="results folder (appended to; a rerun resumes)")
    g.add_argument("--contexts", type=parse_tokens, default=(1024, 8000), help="context lengths, e.g. 1024,8k,32k")
    g.add_argument("--max-tokens", type=int, default=16, help="generated tokens per ttft/blocks request")
    g.add_argument("--system-tokens", type=int, default=0, help="shared system prompt before each unique head")
    g.add_argument(
        "--verify",
        type=int,
        default=1,
        help="outputs re-checked against a recompute: blocks ON requests, sessions ON sessions, per context",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts (the same seed: the same prompts)")
    g.add_argument("--time-budget", type=float, default=None, help="seconds; stop before a unit that would end later")
    g.add_argument(
        "--unit-allowance",
        type=float,
        default=0.0,
        help="seconds added to unit estimates from earlier runs (replica start-up with --sequential)",
    )
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    g.add_argument("--no-progress", action="store_true", help="no progress bar: one line per unit instead")
    g.add_argument("--no-tables", action="store_true", help="do not print the tables at the end")


def run(args: argparse.Namespace) -> int:
    if args.experiment == "pool":
        return run_pool(args)
    if args.experiment == "parse":
        return run_parse(args)
    if args.experiment == "routing":
        return run_routing(args)
    if args.experiment == "report":
        from kvshare.bench.records import ResultsDir
        from kvshare.bench.report import print_tables, write_report

        results = ResultsDir(args.out)
        path, tables = write_report(results)
        if args.compact:
            from kvshare.bench.report import summary_lines

            print("\n".join(summary_lines(results.load())))
        else:
            print_tables(tables)
        print(f"report: {path}")
        return 0
    names = args.experiments if args.experiment == "suite" else (args.experiment,)
    unknown = set(names) - set(EXPERIMENT_NAMES)
    if unknown:
        from kvshare.errors import UserError

        raise UserError(f"unknown experiments {sorted(unknown)}; choose from {', '.join(EXPERIMENT_NAMES)}")
    return _run_experiments(args, names)


def _configs(args: argparse.Namespace, names: tuple[str, ...]) -> list:
    from kvshare.bench.blocks import BlocksConfig
    from kvshare.bench.sessions import SessionsConfig
    from kvshare.bench.ttft import TTFTConfig

    configs = []
    for name in names:
        if name == "ttft":
            configs.append(
                TTFTConfig(
                    contexts=args.contexts, repetitions=args.repetitions, max_tokens=args.max_tokens, client=args.client
                )
            )
        elif name == "blocks":
            configs.append(
                BlocksConfig(
                    contexts=args.contexts,
                    per_block=args.per_block,
                    design=args.design,
                    max_tokens=args.max_tokens,
                    prime_off=args.prime_off,
                    verify=args.verify,
                    prime_batch=args.prime_batch,
                )
            )
        else:
            configs.append(
                SessionsConfig(
                    contexts=args.session_contexts or args.contexts,
                    num_sessions=args.sessions,
                    num_turns=args.turns,
                    turn_tokens=args.turn_tokens,
                    answer_tokens=args.answer_tokens,
                    placements=args.placements,
                    pools=args.pools,
                    verify=args.verify,
                    routers=tuple(args.router),
                )
            )
    return configs


def _run_experiments(args: argparse.Namespace, names: tuple[str, ...]) -> int:
    from rich.console import Console

    from kvshare.bench.harness import Harness
    from kvshare.bench.targets import open_target
    from kvshare.errors import UserError

    replica_args = _started_replica_args(args)
    try:
        configs = _configs(args, names)
        spec = _target_spec(args, replica_args)
        config = _harness_config(args)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    console = Console()
    status = console.status("starting replicas...")
    status.start()
    try:
        with sigterm_as_interrupt(), open_target(spec, progress=status.update) as (replicas, off):
            status.stop()
            outcome = Harness(config, replicas, off, console=console).run(configs)
    except (RuntimeError, TimeoutError, ValueError) as exc:  # replicas that do not start, a plan they cannot run
        raise UserError(f"{type(exc).__name__}: {exc}") from None
    finally:
        status.stop()
    return _report_outcome(args, outcome, console)


def _started_replica_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Arguments of every replica bench starts (--model); a UserError for a mode that only a start can set."""
    from kvshare.errors import UserError

    if args.deterministic and not args.model:
        raise UserError(
            "--deterministic starts replicas in the mode (with --model); replicas given by URL run in "
            "the mode they were started in, which their responses say (kvshare.deterministic)"
        )
    if args.kv_dtype != "auto" and not args.model:
        raise UserError(
            "--kv-dtype starts replicas with that KV dtype (with --model); replicas given by URL run "
            "with the KV dtype they were started with"
        )
    replica_args = tuple(args.replica_arg) + (("--deterministic",) if args.deterministic else ())
    replica_args += ("--kv-dtype", args.kv_dtype) if args.kv_dtype != "auto" else ()
    return replica_args


def _target_spec(args: argparse.Namespace, replica_args: tuple[str, ...]):
    """The replicas to measure: given by URL, or started with --model."""
    import os

    from kvshare.bench.targets import TargetSpec

    return TargetSpec(
        replica_urls=tuple(args.replica),
        off_replica_urls=tuple(args.off_replica),
        model=args.model,
        device=args.device,
        num_replicas=args.replicas,
        pool_size=args.pool_size,
        pool_args=tuple(args.pool_arg),
        replica_args=replica_args,
        is_sequential=args.sequential,
        port=args.port,
        log_dir=os.path.join(args.out, "logs"),
        use_extension=not args.no_extension,
    )


def _harness_config(args: argparse.Namespace):
    """How the experiments run: where results go, the prompts' seed, budgets and timeouts, what is shown."""
    from kvshare.bench.harness import HarnessConfig

    return HarnessConfig(
        out_dir=args.out,
        tokenizer=args.tokenizer or args.model,
        system_tokens=args.system_tokens,
        seed=args.seed,
        time_budget_s=args.time_budget,
        unit_allowance_s=args.unit_allowance,
        timeout_s=args.timeout,
        use_extension=not args.no_extension,
        timeline=args.timeline and not args.no_extension,
        show_progress=not args.no_progress,
    )


def _report_outcome(args: argparse.Namespace, outcome, console) -> int:
    """Print the tables and each experiment's units; the exit code: 0 complete, 3 units left, 130 interrupted."""
    from kvshare.bench.report import print_tables

    if not args.no_tables:
        print_tables(outcome.tables, console)
    for name, result in outcome.runs.items():
        console.print(
            f"{name}: {result.num_done} units run, {result.num_skipped} already recorded, "
            f"{result.num_left} left: {result.stop_reason}"
        )
    console.print(f"report: {outcome.report_path}")
    if outcome.interrupted or any("interrupted" in r.stop_reason for r in outcome.runs.values()):
        return 130
    return 0 if outcome.is_complete else 3
