#!/usr/bin/env python3
"""Real vLLM on a GPU, measured through HTTP as a vLLM user would: kvshare against vLLM's own CPU offloading and
LMCache. ``--setup`` says what is started, ``--modes`` what is measured on it (rows: OUT/rows.json, each row
written as it is taken, with the fields of kvshare.integrations.vllm.gpu_rows; servers' output: OUT/<setup>.log).

setups (every vLLM command line comes from kvshare.integrations.vllm.launch, `kvshare up` included):

  kvshare           kvshare up --engine vllm --replicas 2 --policy alternate (--policy; two replicas, one pool, a
                    router sending prefix hints (--hints off: kvshare up --no-hints); on one GPU each gets 0.45 of
                    it and they start one after the other)
  kvshare-pool-off  the same with --pool off (plain vLLM replicas behind the router)
  kvshare-restart   a pool and one replica at a time: A computes every prompt, stops; B starts and loads them
                    (a shape of which two replicas do not fit one GPU: the pool keeps the pages meanwhile)
  vllm-offloading   one plain vLLM with --kv-offloading-size (vLLM's native CPU tier)
  lmcache-mp        LMCache's multi-process server and two vLLM replicas with LMCacheMPConnector (refused, with
                    what to do, when lmcache is not importable)
  store-cost        a pool, one replica with the connector and one without, side by side

modes:

  ttft         per length, fresh random token-id prompts (the first is the first request of B):
               A cold -> B cross-replica (B never saw it) -> A again (local hit). vllm-offloading: cold, then
               /reset_prefix_cache, then again (a hit from its CPU tier, same replica). Bound: the hit's KV bytes
               over the pinned host->device rate measured in this run.
  on-off       A cold (stores) -> B with the pool off for the request -> B again, pool off (its own GPU prefix
               hit) -> B's prefix cache reset -> B with the pool: greedy tokens and logprobs of B's pool load
               against its own cold run, and against its own prefix hit (the same reuse with B's own bytes)
  store-cost   cold TTFT and decode rate (--decode-tokens) with the connector storing vs plain vLLM,
               requests alternating ABBA, each prompt fresh
  load         --sessions concurrent multi-turn sessions through the router for --duration-s; errors, TTFT
               p50/p99 (run it on kvshare and on kvshare-pool-off)
  bench-serve  `vllm bench serve` (vLLM's own client) with its prefix_repetition dataset against the router
  startup      when each replica of `kvshare up` started and served, and the KV cache vLLM sized for it
  ttft-routed  cold / cross-replica / local TTFT through the router, token-id and chat prompts (vllm_gpu_hints.py)
  stall        decode streams' worst gap while a prefix loads beside them, and while one is computed cold

    python3 benchmarks/vllm_gpu.py --model-dir /tmp/m8b --lengths 32768 131072 --out $OUT
    python3 benchmarks/vllm_gpu.py --setup kvshare --modes startup on-off bench-serve --model-dir /tmp/m8b --out $OUT
    python3 benchmarks/vllm_gpu.py --setup vllm-offloading --model-dir /tmp/m8b --lengths 32768 --out $OUT

``--device cpu`` runs every setup with vLLM CPU (a plumbing check: no bound, CPU timings).
What each setup starts, and the state a mode reads (``Run``), are in vllm_gpu_setups.py; the modes are here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_gpu_client as client  # noqa: E402 (beside this file)
from vllm_gpu_hints import add_hint_mode_arguments, mode_stall, mode_ttft_routed  # noqa: E402
from vllm_gpu_setups import Run, env_for_servers, pool, server_config, servers, setup  # noqa: E402

from kvshare.integrations.vllm import gpu_rows  # noqa: E402

SETUPS = {  # what each setup can measure; the first mode is its default
    "kvshare": ("ttft", "startup", "on-off", "load", "bench-serve", "ttft-routed", "stall"),
    "kvshare-pool-off": ("load", "startup", "bench-serve"),
    "kvshare-restart": ("ttft",),
    "vllm-offloading": ("ttft",),
    "lmcache-mp": ("ttft", "stall"),
    "store-cost": ("store-cost",),
}
ENGINE_OF_SETUP = {"vllm-offloading": "vllm-offloading", "lmcache-mp": "lmcache-mp"}  # the others: kvshare
LMCACHE_MISSING = (
    "--setup lmcache-mp needs LMCache importable by this interpreter ({python}); on the GPU machine "
    "run `bash .vk/lmcache_install.sh` and `. /tmp/lmc_site/lmc_env.sh` first (../shared/vllm-gpu/"
    'README.md, "LMCache beside it"). Nothing was started.'
)


def warm_up(run: Run) -> None:
    """A short prompt of its own on each replica (no shared prefix): the first request pays one-time costs."""
    for url in run.urls:
        run.complete(url, run.prompt(600), 4)


def mode_ttft(run: Run) -> None:
    a, engine = run.args, ENGINE_OF_SETUP.get(run.args.setup, "kvshare")
    for length in a.lengths:
        for _ in range(a.prompts):
            prompt = run.prompt(length)
            cold = run.complete(run.urls[0], prompt)
            if engine == "vllm-offloading":
                client.post(run.urls[0], "/reset_prefix_cache")
                cross, local = None, run.complete(run.urls[0], prompt)
                kind = "vllm-cpu-offloading (same replica, GPU prefix cache reset)"
            else:
                time.sleep(a.settle_s)  # LMCache stores after the request ends
                cross = run.complete(run.urls[1], prompt)
                local = run.complete(run.urls[0], prompt)
                kind = "vllm-prefix-cache (A)"
            run.rows.add(
                {
                    "mode": "ttft",
                    **gpu_rows.ttft_row(
                        **run.base_row(),
                        prompt_tokens=length,
                        engine=engine,
                        cold=cold,
                        cross=cross,
                        local=local,
                        kv_bytes_per_token=run.per_token,
                        h2d_bytes_per_s=run.h2d,
                        first_request=run.first,
                        local_kind=kind,
                    ),
                }
            )
            run.first = False


def mode_on_off(run: Run) -> None:
    a = run.args
    for length in a.lengths:
        for _ in range(a.prompts):
            prompt = run.prompt(length)
            pool_off = {"kvshare": {"use_pool": False}}
            a_cold = run.complete(run.urls[0], prompt, a.on_off_tokens)  # A computes it and stores it
            off = run.complete(run.urls[1], prompt, a.on_off_tokens, kv_transfer_params=pool_off)
            own_hit = run.complete(run.urls[1], prompt, a.on_off_tokens, kv_transfer_params=pool_off)
            client.post(run.urls[1], "/reset_prefix_cache")
            on = run.complete(run.urls[1], prompt, a.on_off_tokens)
            run.rows.add(
                gpu_rows.on_off_row(
                    **run.base_row(),
                    prompt_tokens=length,
                    off=off,
                    on=on,
                    batch_invariant=a.batch_invariant,
                    own_hit=own_hit,
                    a_cold=a_cold,
                )
            )


def mode_store_cost(run: Run) -> None:
    a = run.args
    for length in a.lengths:
        storing, plain = [], []
        for i in range(a.store_cost_requests):
            pair = ((0, storing), (1, plain)) if i % 2 == 0 else ((1, plain), (0, storing))  # ABBA
            for index, into in pair:
                time.sleep(a.settle_s)  # vLLM busy-polls its queues for a while after a step: not into the next
                into.append(run.complete(run.urls[index], run.prompt(length), a.decode_tokens))
        run.rows.add(gpu_rows.store_cost_row(**run.base_row(), prompt_tokens=length, storing=storing, plain=plain))


def mode_load(run: Run) -> None:
    a = run.args
    tally = client.run_sessions(
        run.router,
        run.served,
        run.vocab,
        a.sessions,
        a.duration_s,
        a.document_tokens,
        a.turn_tokens,
        min(a.load_max_context, a.max_model_len - 16),
        a.max_tokens,
        a.seed,
    )
    row = gpu_rows.load_row(
        **run.base_row(),
        pool="off" if a.setup == "kvshare-pool-off" else "on",
        num_sessions=a.sessions,
        duration_s=a.duration_s,
        ttfts_s=tally.ttfts_s,
        num_errors=len(tally.errors),
        num_requests=tally.num_requests,
        cached_tokens=tally.cached_tokens,
        prompt_tokens=tally.prompt_tokens,
    )
    row["first_errors"] = tally.errors[:5]
    run.rows.add(row)


def mode_bench_serve(run: Run) -> None:
    a = run.args
    name = f"bench-serve-{a.setup}.json"
    cmd = client.bench_serve_command(
        run.router,
        run.served,
        a.model_dir,
        a.out,
        name,
        a.bench_prefix_len,
        a.bench_suffix_len,
        a.bench_num_prefixes,
        a.bench_output_len,
        a.bench_num_prompts,
        a.bench_concurrency,
    )
    shown = ["vllm", "bench", "serve", *cmd[3:]]  # what it runs, as vLLM's command line says it
    print("$ " + " ".join(shown), flush=True)
    code = client.run_bench_serve(cmd, os.path.join(a.out, f"bench-serve-{a.setup}.log"), a.bench_timeout_s)
    if code != 0 or not os.path.exists(os.path.join(a.out, name)):
        raise RuntimeError(f"vllm bench serve exited with {code} (see {a.out}/bench-serve-{a.setup}.log)")
    with open(os.path.join(a.out, name)) as f:
        result = json.load(f)
    target = f"router, pool {'off' if a.setup == 'kvshare-pool-off' else 'on'}"
    run.rows.add(gpu_rows.bench_serve_row(**run.base_row(), target=target, result=result, command=shown))


def mode_startup(run: Run) -> None:
    with open(run.log_path, errors="replace") as f:
        lines = f.read().splitlines()
    run.rows.add(gpu_rows.startup_row(**run.base_row(), device=run.args.device, log_lines=lines))


MODES = {
    "ttft": mode_ttft,
    "on-off": mode_on_off,
    "store-cost": mode_store_cost,
    "load": mode_load,
    "bench-serve": mode_bench_serve,
    "startup": mode_startup,
    "ttft-routed": mode_ttft_routed,
    "stall": mode_stall,
}


def run_restart(run: Run, env: dict, log) -> None:
    """kvshare-restart: A computes every prompt and stops; B starts on the same pool and loads them."""
    a = run.args
    prompts = [(length, run.prompt(length)) for length in a.lengths for _ in range(a.prompts)]
    with pool(run, log) as socket_path:
        with servers(run, [server_config(run, a.port + 1, "A", pool_socket=socket_path)], env, log, True) as urls:
            run.urls = urls
            warm_up(run)
            colds = [run.complete(urls[0], prompt) for _, prompt in prompts]
        with servers(run, [server_config(run, a.port + 2, "B", pool_socket=socket_path)], env, log, True) as urls:
            run.urls = urls
            warm_up(run)
            for (length, prompt), cold in zip(prompts, colds):
                cross = run.complete(urls[0], prompt)
                local = run.complete(urls[0], prompt)
                run.rows.add(
                    {
                        "mode": "ttft",
                        **gpu_rows.ttft_row(
                            **run.base_row(),
                            prompt_tokens=length,
                            engine="kvshare",
                            cold=cold,
                            cross=cross,
                            local=local,
                            kv_bytes_per_token=run.per_token,
                            h2d_bytes_per_s=run.h2d,
                            first_request=run.first,
                            local_kind="vllm-prefix-cache (B, after its load)",
                        ),
                    }
                )
                run.first = False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", choices=tuple(SETUPS), default="kvshare")
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=None, help="default: the setup's first")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--model-name", default="qwen3-8b", help="the shape's name in the rows")
    p.add_argument("--load-format", default=None, help="vLLM's --load-format (dummy: random weights, none read)")
    p.add_argument("--model-revision", default="", help="the connector's model_revision (needed with dummy weights)")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768])
    p.add_argument("--prompts", type=int, default=2, help="prompts per length (the first is B's first request)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--on-off-tokens", type=int, default=32, help="tokens compared per on-off prompt")
    p.add_argument("--batch-invariant", action="store_true", help="VLLM_BATCH_INVARIANT=1 for the servers")
    p.add_argument("--decode-tokens", type=int, default=128, help="store-cost: tokens per request (decode rate)")
    p.add_argument("--store-cost-requests", type=int, default=4, help="store-cost: requests per server and length")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--document-tokens", type=int, default=4096, help="load: shared opening of each conversation")
    p.add_argument("--turn-tokens", type=int, default=256, help="load: new tokens of each turn")
    p.add_argument("--load-max-context", type=int, default=16384, help="load: a conversation ends before this")
    p.add_argument("--bench-prefix-len", type=int, default=8192)
    p.add_argument("--bench-suffix-len", type=int, default=256)
    p.add_argument("--bench-num-prefixes", type=int, default=4)
    p.add_argument("--bench-output-len", type=int, default=64)
    p.add_argument("--bench-num-prompts", type=int, default=64)
    p.add_argument("--bench-concurrency", type=int, default=8)
    p.add_argument("--bench-timeout-s", type=float, default=400)
    p.add_argument("--max-model-len", type=int, default=135168)
    p.add_argument("--pool-size", default="40GiB")
    p.add_argument("--offloading-gib", type=float, default=40.0)
    p.add_argument("--lmcache-port", type=int, default=5555)
    p.add_argument("--lmcache-l1-gb", type=float, default=40.0)
    p.add_argument(
        "--lmcache-server-arg",
        action="append",
        default=[],
        help="an argument for LMCache's server (e.g. its chunk size)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        default="",
        help="every replica's --kv-cache-memory-bytes (then replicas sharing a GPU may start together)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=1.0,
        help="pause between a cold request and the cross one, and before each store-cost request",
    )
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--ready-timeout-s", type=float, default=400)
    p.add_argument("--replica-arg", action="append", default=[], help="an argument for every vLLM replica")
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a plumbing run with vLLM CPU (no bound)"
    )
    add_hint_mode_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.modes = args.modes or [SETUPS[args.setup][0]]
    wrong = [m for m in args.modes if m not in SETUPS[args.setup]]
    if wrong:
        p.error(f"--setup {args.setup} measures {', '.join(SETUPS[args.setup])}, not {', '.join(wrong)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup == "lmcache-mp" and importlib.util.find_spec("lmcache") is None:
        print("vllm_gpu.py: error: " + LMCACHE_MISSING.format(python=sys.executable), file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the servers (finally)
    os.makedirs(args.out, exist_ok=True)
    run = Run(args)
    env = env_for_servers(args)
    with open(run.log_path, "a") as log:
        if args.setup == "kvshare-restart":
            run_restart(run, env, log)
            return 0
        with setup(run, env, log):
            print(f"{args.setup} ready", flush=True)
            warm_up(run)
            for mode in args.modes:
                started = time.monotonic()
                MODES[mode](run)
                print(f"{mode} done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
