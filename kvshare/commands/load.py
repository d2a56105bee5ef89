"""Drive many concurrent sessions through a router (loopback only) for a set time; check sampled answers
against a pool-off reference (equal token ids at temperature 0); report requests/s, latency percentiles,
errors and mismatches. Exits 1 on any error, mismatch or unfinished request, or a pool left inconsistent."""

from __future__ import annotations

import argparse
import contextlib
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the router's (or a replica's) base URL; loopback addresses only")
    p.add_argument("--sessions", type=int, default=32, help="concurrent sessions")
    p.add_argument("--duration", type=float, default=60.0, help="seconds during which requests are started")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--min-document", type=int, default=300, help="characters of the shortest shared opening")
    p.add_argument("--max-document", type=int, default=1200, help="characters of the longest shared opening")
    p.add_argument("--max-context", type=int, default=2048, help="a conversation ends before its prompt passes this")
    p.add_argument("--documents", type=int, default=4, help="shared openings (prefixes sessions reuse)")
    p.add_argument("--chat-share", type=float, default=0.5, help="share of sessions that chat (others: completions)")
    p.add_argument("--check-share", type=float, default=0.1, help="share of answers compared with a pool-off reference")
    p.add_argument("--seed", type=int, default=0, help="seed of the sessions and prompts")
    p.add_argument("--model", default=None, help="model name (default: the first the server lists)")
    p.add_argument(
        "--api-key", default=os.environ.get("KVSHARE_API_KEY"), help="bearer token (default: $KVSHARE_API_KEY)"
    )
    p.add_argument("--tenant-header", default="", help="spread sessions over --tenants tenants by this header")
    p.add_argument("--tenants", type=int, default=0, help="tenants the sessions are spread over (with --tenant-header)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")
    p.add_argument(
        "--pool",
        default=None,
        metavar="SOCKET",
        help="after the run, check this pool: no leases or reservations left, index consistent",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    import json

    from kvshare.errors import UserError
    from kvshare.reliability.load import LoadConfig, check_pool, run_load
    from kvshare.reliability.summary import render

    try:
        config = LoadConfig(
            url=args.url,
            num_sessions=args.sessions,
            duration_s=args.duration,
            max_tokens=args.max_tokens,
            min_document_chars=args.min_document,
            max_document_chars=args.max_document,
            max_context_tokens=args.max_context,
            num_documents=args.documents,
            chat_share=args.chat_share,
            check_share=args.check_share,
            seed=args.seed,
            model=args.model,
            api_key=args.api_key,
            tenant_header=args.tenant_header,
            num_tenants=args.tenants,
            request_timeout_s=args.request_timeout,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    try:
        with load_progress(config.duration_s) as on_progress:
            summary = run_load(config, on_progress)
    except RuntimeError as exc:
        raise UserError(str(exc)) from None
    is_pool_ok = True
    if args.pool:
        summary["pool"] = check_pool(args.pool)
        is_pool_ok = (
            summary["pool"]["integrity"] == "ok"
            and summary["pool"]["leases"] == 0
            and summary["pool"]["reservations"] == 0
        )
    print(json.dumps(summary, indent=2) if args.json else render(summary), flush=True)
    is_clean = summary["errors"] == 0 and summary["mismatches"] == 0 and summary["unfinished"] == 0
    return 0 if is_clean and is_pool_ok and summary["references_not_cold"] == 0 else 1


@contextlib.contextmanager
def load_progress(duration_s: float, console=None):
    """A progress bar on stderr (rich; ``console``: another rich Console): the run's time, requests, errors,
    response bytes and their rate."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvshare.units import format_bytes

    columns = (TextColumn("load"), BarColumn(), TimeElapsedColumn(), TextColumn("{task.fields[detail]}"))
    with Progress(*columns, console=console or Console(stderr=True), transient=True) as progress:
        task = progress.add_task("load", total=duration_s, detail="starting")

        def on_progress(tally, elapsed_s: float) -> None:
            rate = tally.num_bytes / elapsed_s if elapsed_s > 0 else 0.0
            progress.update(
                task,
                completed=min(elapsed_s, duration_s),
                detail=f"{tally.num_ok} ok, {tally.num_errors} errors, "
                f"{format_bytes(tally.num_bytes)} at {format_bytes(rate)}/s",
            )

        yield on_progress
