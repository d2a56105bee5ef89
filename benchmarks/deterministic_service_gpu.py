"""Pool ON == pool OFF, bitwise, through the service: `kvshare serve --deterministic`, as a user runs it.

    PYTHONPATH=. python3 benchmarks/deterministic_service_gpu.py --out DIR
        [--cases 8b:32768,8b:131072,32b:32768,32b:131072] [--sessions 8b:32768] [--max-tokens 64]
        [--grid-tokens 2048] [--layout auto|together|sequential] [--time-budget 540] [--device cuda]
    PYTHONPATH=. python3 benchmarks/deterministic_service_gpu.py --out DIR --device cpu --model tiny --tokens 1024
        [--layout sequential]   (a dry run: the same steps on the tiny model)

Per model one cluster of child processes (up_cluster.py): a pool, a round-robin router and two replicas A and
B, each `kvshare serve --deterministic --chunk-tokens C --grid-tokens G --max-model-len L --verify-rate 0
--local-cache-size S` (no checksum is verified, so the flipped byte below reaches the model). The layout is
``together`` (`kvshare up --replicas 2`) where two replicas fit the GPU, else ``sequential``: A serves every
A step, then A is stopped and B started in its place against the same pool (the 32B shape on an H200).
Every request is a completion of token ids at temperature 0 with --max-tokens tokens, ignore_eos,
return_token_ids and top-5 logprobs; "logprobs" compared per step are the chosen token's logprob and the
top-5 values. Pool OFF is the request extension {"use_pool": false, "use_local_cache": false}.

  per case (model, n), a fresh random prompt of n token ids:
    off     A, pool and cache off           the reference
    prime   A, pool and cache on            computes and stores every full chunk (checked too)
    local   A, {"use_pool": false}          reuses A's local prefix cache
    cross   B, {"use_local_cache": false}   loads A's pages from the pool (sequential: after B replaced A)
  per model, the negative control: a fresh prompt of the model's shortest case, off and prime on A, then one
    byte of one of its pooled pages flipped (the high byte of a K value of chunk 1, through the pool's shared
    memory), then cross on B: the exact check must fail (case flipped_byte_control)
  per session (model, n), together only: six turns through the router (turn k on replica k % 2), turn 0 a
    fresh n-token prompt, turn k the previous prompt + its output + --turn-tokens new ids; each turn against
    its pool-off recompute on A (case session_turn_k)

Each row: model, prompt_tokens, case, layout, tokens_equal, logprobs_equal, first_difference (step, both
tokens and logprobs; null when equal), expected (equal | differ), passed, replica, local/pool/computed
tokens, seconds. A step whose estimate (the H200 figures below) would end past --time-budget is skipped and
named in "skipped"; in the sequential layout a step on A reserves B's start and every B part. Writes
DIR/deterministic_service.json and a line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # up_cluster and the plan beside this script

from deterministic_service_plan import GiB, ModelPlan, Step, fit_prompt, plan_model  # noqa: E402
from up_cluster import Cluster, ClusterSpec  # noqa: E402

from kvshare.validate.service_http import get_json, post_json  # noqa: E402

ALIASES = {"8b": "qwen3-8b", "32b": "qwen3-32b", "tiny": "tiny"}
TOP_LOGPROBS = 5
POOL_OFF = {"use_pool": False, "use_local_cache": False}
POOL_ONLY = {"use_pool": True, "use_local_cache": False}
LOCAL_ONLY = {"use_pool": False, "use_local_cache": True}
ROW_FIELDS = (
    "model",
    "prompt_tokens",
    "case",
    "layout",
    "tokens_equal",
    "logprobs_equal",
    "expected",
    "passed",
    "first_difference",
    "replica",
    "local_tokens",
    "pool_tokens",
    "computed_tokens",
    "seconds",
)


def parse_pairs(text: str) -> list[tuple[str, int]]:
    """ "8b:32768,32b:131072" -> [("qwen3-8b", 32768), ("qwen3-32b", 131072)]."""
    pairs = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, tokens = item.partition(":")
        if not tokens:
            raise ValueError(f"{item!r}: give MODEL:TOKENS, e.g. 8b:32768")
        pairs.append((ALIASES.get(name.lower(), name), int(tokens)))
    return pairs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", help="the replicas' --device (cpu, cuda, cuda:N)")
    p.add_argument("--cases", default="8b:32768,8b:131072,32b:32768,32b:131072", help="MODEL:TOKENS list")
    p.add_argument("--sessions", default="8b:32768", help="MODEL:TOKENS of six-turn sessions ('' for none)")
    p.add_argument("--model", default=None, help="shorthand: --cases and --sessions MODEL:--tokens")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument(
        "--layout",
        choices=("auto", "together", "sequential"),
        default="auto",
        help="auto: together where two replicas fit the GPU, else sequential",
    )
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-tokens", type=int, default=512, help="new user ids per session turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--grid-tokens", type=int, default=None, help="default 2048 on CUDA, the chunk on CPU")
    p.add_argument("--pool-size", default=None, help="default: every prompt's pages x 1.25 + 2 GiB")
    p.add_argument(
        "--local-cache-size",
        type=int,
        default=None,
        help="bytes, at most (default: the longest prompt's KV, as far as the GPU has room)",
    )
    p.add_argument("--no-control", action="store_true", help="skip the flipped-byte negative control")
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds; steps that would end past it are skipped")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=19)
    args = p.parse_args(argv)
    if args.model is not None:
        pair = f"{args.model}:{args.tokens or 1024}"
        args.cases, args.sessions = pair, pair
    args.case_list = [(m, fit_prompt(m, n, args.max_tokens)) for m, n in parse_pairs(args.cases)]
    args.session_list = parse_pairs(args.sessions)
    args.grid_tokens = args.grid_tokens or (args.chunk_tokens if args.device == "cpu" else 2048)
    if args.grid_tokens % args.chunk_tokens:
        raise SystemExit(f"--grid-tokens {args.grid_tokens} must be a multiple of --chunk-tokens {args.chunk_tokens}")
    return args


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, time.monotonic()

    def allows(self, step: str, needs_s: float, skipped: list[str]) -> bool:
        elapsed = time.monotonic() - self.started
        if elapsed + needs_s <= self.seconds:
            return True
        skipped.append(f"{step} (needs ~{needs_s:.0f} s, {self.seconds - elapsed:.0f} s left)")
        print(f"skip {step}: needs ~{needs_s:.0f} s, {self.seconds - elapsed:.0f} s of the budget left", flush=True)
        return False


def gpu_free_bytes(device: str) -> int | None:
    """Free bytes of ``device`` (None on CPU), asked in a child so this process holds no CUDA context."""
    if device == "cpu":
        return None
    code = f"import torch; print(torch.cuda.mem_get_info(torch.device({device!r}))[0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


# -- comparison ------------------------------------------------------------------------------------------


def step_logprobs(choice: dict) -> list[list[float]]:
    """Per generated step: the chosen token's logprob, then the top values (sorted; text keys may collapse)."""
    lp = choice.get("logprobs") or {}
    chosen, tops = lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    return [
        [float(c) if c is not None else float("nan"), *sorted(map(float, (t or {}).values()), reverse=True)]
        for c, t in zip(chosen, tops)
    ]


def compare(reference: dict, got: dict, expected: str = "equal") -> dict:
    """The exact rule of kvshare.outputs on two responses: ids, then logprobs, bit for bit."""
    from kvshare.outputs import compare_tokens

    ref_ids, ids = reference["token_ids"], got["token_ids"]
    ref_lp, lp = reference["logprobs"], got["logprobs"]
    cmp = compare_tokens(ref_ids, ids, ref_lp, candidate_top_logprobs=lp, is_exact=True)
    tokens_equal = ref_ids == ids
    logprobs_equal = (
        len(ref_lp) == len(lp) == len(ids) and not cmp.is_logprob_divergence and (tokens_equal and cmp.is_identical)
    )
    first = None
    if not (tokens_equal and logprobs_equal):
        step = cmp.divergence_step if cmp.divergence_step is not None else cmp.num_compared
        first = {
            "step": step,
            "reference_token": _at(ref_ids, step),
            "token": _at(ids, step),
            "reference_logprobs": _at(ref_lp, step),
            "logprobs": _at(lp, step),
            "detail": cmp.describe(),
        }
    is_equal = tokens_equal and logprobs_equal
    return {
        "tokens_equal": tokens_equal,
        "logprobs_equal": logprobs_equal,
        "first_difference": first,
        "expected": expected,
        "passed": is_equal if expected == "equal" else not is_equal,
    }


def _at(seq, i):
    return seq[i] if i < len(seq) else None


def complete(base: str, model: str, ids: list[int], max_tokens: int, extension: dict | None, timeout_s: float) -> dict:
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": TOP_LOGPROBS,
    }
    if extension is not None:
        body["kvshare"] = extension
    started = time.perf_counter()
    out = post_json(base + "/v1/completions", body, timeout_s)
    choice, p = out["choices"][0], out.get("kvshare") or {}
    return {
        "token_ids": [int(t) for t in choice["token_ids"]],
        "logprobs": step_logprobs(choice),
        "replica": p.get("replica"),
        "local_tokens": p.get("local_tokens"),
        "pool_tokens": p.get("pool_tokens"),
        "computed_tokens": p.get("computed_tokens"),
        "deterministic": p.get("deterministic"),
        "seconds": round(time.perf_counter() - started, 3),
    }


def make_row(model: str, n: int, case: str, reference: dict, got: dict, expected: str = "equal") -> dict:
    row = {"model": model, "prompt_tokens": n, "case": case, **compare(reference, got, expected)}
    row.update(
        {
            k: got.get(k)
            for k in ("replica", "local_tokens", "pool_tokens", "computed_tokens", "seconds", "deterministic")
        }
    )
    row["reference_seconds"] = reference.get("seconds")
    return row


# -- the steps: a part on A, then (together: at once; sequential: once B replaced A) a part on B -------------


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab - 4) for _ in range(n)]


def case_on_a(c: Cluster, args, plan: ModelPlan, n: int, rng: random.Random) -> dict:
    ids = random_ids(rng, n, plan.vocab)
    call = lambda ext: complete(c.urls["A"], plan.model, ids, args.max_tokens, ext, args.request_timeout)  # noqa: E731
    off = call(POOL_OFF)
    return {"ids": ids, "off": off, "prime": call({}), "local": call(LOCAL_ONLY)}


def case_on_b(c: Cluster, args, plan: ModelPlan, n: int, got: dict) -> list[dict]:
    cross = complete(c.urls["B"], plan.model, got["ids"], args.max_tokens, POOL_ONLY, args.request_timeout)
    rows = [
        make_row(plan.model, n, case, got["off"], result)
        for case, result in (("prime", got["prime"]), ("cross", cross), ("local", got["local"]))
    ]
    for row in rows[1:]:
        # equal because nothing was reused proves nothing
        if not (row["pool_tokens"] or 0) + (row["local_tokens"] or 0):
            row["passed"], row["error"] = False, "nothing reused"
    return rows


def control_on_a(c: Cluster, args, plan: ModelPlan, n: int, rng: random.Random) -> dict:
    from kvshare.engine.presets import get_preset
    from kvshare.keys import chunk_keys
    from kvshare.layout import KVLayout
    from kvshare.pool.client import PoolClient

    a = c.urls["A"]
    ids = random_ids(rng, n, plan.vocab)
    off = complete(a, plan.model, ids, args.max_tokens, POOL_OFF, args.request_timeout)
    complete(a, plan.model, ids, args.max_tokens, {}, args.request_timeout)  # stores the pages
    mc = get_preset(plan.model).config
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, args.chunk_tokens)
    digest = bytes.fromhex(get_json(a + "/admin/namespace")["namespace"])  # B's too: same model and arguments
    with PoolClient(c.pool_socket) as client:
        pages = client.lookup(chunk_keys(digest, ids, args.chunk_tokens), layout.page_bytes, lease=False).pages
        if len(pages) < 2:
            raise RuntimeError(f"the pool holds {len(pages)} pages of the control prompt; 2 or more needed")
        offset = 1000 * layout.itemsize + layout.itemsize - 1  # high byte (sign, exponent) of a K value, layer 0
        client.page(pages[1].offset, pages[1].page_bytes)[offset] ^= 0xFF  # chunk 1
    return {"ids": ids, "off": off}


def control_on_b(c: Cluster, args, plan: ModelPlan, n: int, got: dict) -> list[dict]:
    cross = complete(c.urls["B"], plan.model, got["ids"], args.max_tokens, POOL_ONLY, args.request_timeout)
    row = make_row(plan.model, n, "flipped_byte_control", got["off"], cross, expected="differ")
    if not cross["pool_tokens"]:
        row["passed"], row["error"] = False, "the control loaded nothing from the pool"
    return [row]


def run_session(c: Cluster, args, plan: ModelPlan, n: int, rng: random.Random) -> list[dict]:
    ids, rows = random_ids(rng, n, plan.vocab), []
    for turn in range(args.turns):
        reference = complete(c.urls["A"], plan.model, ids, args.max_tokens, POOL_OFF, args.request_timeout)
        got = complete(c.router, plan.model, ids, args.max_tokens, None, args.request_timeout)
        row = make_row(plan.model, len(ids), f"session_turn_{turn}", reference, got)
        row["expected_replica"] = f"replica{turn % 2}"
        if turn > 0 and not (got["pool_tokens"] or got["local_tokens"]):
            row["passed"], row["error"] = False, "a later turn reused nothing"
        rows.append(row)
        ids = ids + got["token_ids"] + random_ids(rng, args.turn_tokens, plan.vocab)
    return rows


PARTS = {"case": (case_on_a, case_on_b), "control": (control_on_a, control_on_b), "session": (run_session, None)}


# -- one model's cluster ---------------------------------------------------------------------------------


def cluster_spec(args, plan: ModelPlan) -> ClusterSpec:
    replica_args = (
        "--deterministic",
        "--chunk-tokens",
        str(args.chunk_tokens),
        "--grid-tokens",
        str(args.grid_tokens),
        "--max-model-len",
        str(plan.max_model_len),
        "--verify-rate",
        "0",
        "--local-cache-size",
        str(plan.local_cache_bytes),
    )
    return ClusterSpec(
        layout=plan.layout,
        model=plan.model,
        device=args.device,
        pool_size=plan.pool_size,
        replica_args=replica_args,
        start_timeout_s=max(600.0, 3 * plan.start_s),
    )


def attempt(name: str, fn, out: dict):
    """fn()'s result, or None with the error recorded (the other steps still run)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a step reports what failed and the run goes on
        traceback.print_exc()
        out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        return None


def run_model(args, plan: ModelPlan, budget: Budget, out: dict, rng: random.Random, save) -> None:
    """The plan's steps on a cluster of its own; rows, steps, skips and errors go to ``out``, ``save()`` after
    each step."""
    if plan.layout is None:
        out["skipped"].append(f"{plan.model}: {plan.reason}")
        print(f"skip {plan.model}: {plan.reason}", flush=True)
        return
    for reason in plan.skipped:
        out["skipped"].append(reason)
        print(f"skip {reason}", flush=True)
    sequential = plan.layout == "sequential"
    first = plan.steps[0].a_s + plan.steps[0].b_s if plan.steps else 0.0
    if not budget.allows(f"{plan.model} cluster start", plan.start_s + plan.swap_s + first, out["skipped"]):
        return
    cluster = Cluster(cluster_spec(args, plan))
    record = {
        "model": plan.model,
        "layout": plan.layout,
        "max_model_len": plan.max_model_len,
        "local_cache_bytes": plan.local_cache_bytes,
        "pool_size": plan.pool_size,
    }
    out["clusters"].append(record)

    def finish(step: Step, got, seconds_on_a: float) -> None:
        t0 = time.monotonic()
        on_b = PARTS[step.kind][1]
        rows = got if on_b is None else attempt(step.name, lambda: on_b(cluster, args, plan, step.tokens, got), out)
        if rows is None:
            return
        for r in rows:
            r["layout"] = plan.layout
            print(format_row(r), flush=True)
        out["rows"] += rows
        out["steps"].append(
            {
                "step": step.name,
                "estimate_s": round(step.a_s + step.b_s, 1),
                "seconds": round(seconds_on_a + time.monotonic() - t0, 1),
            }
        )
        save()

    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.phase("A")
        record["start_s"] = round(time.monotonic() - t0, 1)
        waiting = []  # sequential: (step, what A returned, its seconds) until B is up
        for step in plan.steps:
            later = plan.swap_s + sum(s.b_s for s, _, _ in waiting) if sequential else 0.0
            if not budget.allows(step.name, step.a_s + step.b_s + later, out["skipped"]):
                continue
            t1 = time.monotonic()
            got = attempt(step.name, lambda: PARTS[step.kind][0](cluster, args, plan, step.tokens, rng), out)
            if got is None:
                continue
            if sequential:
                waiting.append((step, got, time.monotonic() - t1))
            else:
                finish(step, got, time.monotonic() - t1)
        if waiting:
            t0 = time.monotonic()
            cluster.phase("B")
            record["swap_s"] = round(time.monotonic() - t0, 1)
            for step, got, seconds_on_a in waiting:
                finish(step, got, seconds_on_a)
    except Exception as exc:  # noqa: BLE001 - the cluster failed: recorded, the next model still runs
        traceback.print_exc()
        out["errors"].append(f"{plan.model} cluster: {type(exc).__name__}: {exc}")
    finally:
        cluster.stop()
        record["commands"] = cluster.commands


def format_row(r: dict) -> str:
    diff = r["first_difference"]
    where = "-" if diff is None else f"step {diff['step']}: {diff['reference_token']} vs {diff['token']}"
    return (
        f"{r['model']:<10} {r['prompt_tokens']:>7} {r['case']:<22} tokens_equal={r['tokens_equal']!s:<5} "
        f"logprobs_equal={r['logprobs_equal']!s:<5} expected={r['expected']:<6} "
        f"{'PASS' if r['passed'] else 'FAIL'} pool={r['pool_tokens']} local={r['local_tokens']} "
        f"replica={r['replica']} {where}{' (' + r['error'] + ')' if r.get('error') else ''}"
    )


def save(out: dict, path: str, started: float) -> None:
    """Write the JSON as it stands (after every step: a command stopped by its time limit keeps its rows)."""
    out["passed"] = bool(out["rows"]) and all(r["passed"] for r in out["rows"]) and not out["errors"]
    out["seconds"] = round(time.monotonic() - started, 1)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt()


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    budget, rng = Budget(args.time_budget), random.Random(args.seed)
    path = os.path.join(args.out, "deterministic_service.json")
    out = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("case_list", "session_list")},
        "plans": [],
        "rows": [],
        "steps": [],
        "clusters": [],
        "skipped": [],
        "errors": [],
    }
    previous = signal.signal(signal.SIGTERM, _interrupt)  # timeout(1): the clusters stopped, the rows kept
    try:
        free = gpu_free_bytes(args.device)
        for model in dict.fromkeys(m for m, _ in [*args.case_list, *args.session_list]):
            plan = plan_model(args, model, free)
            out["plans"].append({**vars(plan), "steps": [vars(s) for s in plan.steps]})
            print(
                f"{model}: {plan.layout or 'skipped'}, max_model_len {plan.max_model_len}, local cache "
                f"{plan.local_cache_bytes / GiB:.1f} GiB, pool {plan.pool_size}; steps "
                + ", ".join(f"{s.name} ~{s.a_s + s.b_s:.0f} s" for s in plan.steps),
                flush=True,
            )
            run_model(args, plan, budget, out, rng, lambda: save(out, path, budget.started))
    except KeyboardInterrupt:
        out["errors"].append("stopped (SIGTERM or Ctrl-C): the rows so far are kept")
    finally:
        signal.signal(signal.SIGTERM, previous)
        save(out, path, budget.started)
    print(
        f"wrote {path}: {len(out['rows'])} rows, passed {out['passed']}, skipped {len(out['skipped'])}, "
        f"errors {len(out['errors'])}, {out['seconds']} s",
        flush=True,
    )
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
