"""Pool ON == pool OFF, bitwise, through the service (issue 19): `kvshare up --deterministic`, as a user runs it.

    PYTHONPATH=. python3 benchmarks/deterministic_service_gpu.py --out DIR
        [--cases 8b:32768,8b:131072,32b:32768,32b:131072] [--sessions 8b:32768] [--max-tokens 64]
        [--grid-tokens 2048] [--time-budget 540] [--device cuda]
    PYTHONPATH=. python3 benchmarks/deterministic_service_gpu.py --out DIR --device cpu --model tiny --tokens 1024
        (a dry run: the same steps on the tiny model)

Per model one cluster, started as a subprocess: `python -m kvshare up --deterministic --model PRESET
--device D --replicas 2 --policy round_robin --pool-size S --port P --replica-arg ...` (replicas with
--chunk-tokens, --grid-tokens, --max-model-len and --verify-rate 0: no checksum is verified in this run,
so the flipped byte below reaches the model). Every request is a completion of token ids at temperature
0 with --max-tokens tokens, ignore_eos, return_token_ids and top-5 logprobs; "logprobs" compared per step
are the chosen token's logprob and the top-5 values. Pool OFF is the request extension
{"use_pool": false, "use_local_cache": false} (nothing loaded, nothing stored: every token computed).

  per case (model, n), a fresh random prompt of n token ids:
    off     replica0, pool and cache off         the reference
    prime   replica0, pool and cache on          computes and stores every full chunk (checked too)
    cross   replica1, {"use_local_cache": false} loads replica0's pages from the pool
    local   replica0, {"use_pool": false}        reuses replica0's local prefix cache
  per session (model, n): six turns through the router (round robin: turn k on replica k % 2), turn 0 a
    fresh n-token prompt, turn k the previous prompt + its output + --turn-tokens new ids; each turn against
    its pool-off recompute on replica0 (case session_turn_k)
  per model, the negative control: a fresh prompt of the model's shortest case, off and prime on replica0,
    then one byte of one of its pooled pages flipped (the high byte of a K value of chunk 1, through the
    pool's shared memory), then cross on replica1: the exact check must fail (case flipped_byte_control)

Each row: model, prompt_tokens, case, tokens_equal, logprobs_equal, first_difference (step, both tokens and
logprobs; null when equal), expected (equal | differ), passed, replica, local/pool/computed tokens, seconds.
A step whose estimate (from the H200 figures of docs/results/h200/deterministic/) would end past
--time-budget is skipped and named in "skipped". Writes DIR/deterministic_service.json and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # up_cluster beside this script

from kvshare.validate.service_http import get_json, post_json  # noqa: E402
from up_cluster import UpCluster  # noqa: E402

ALIASES = {"8b": "qwen3-8b", "32b": "qwen3-32b", "tiny": "tiny"}
TOP_LOGPROBS = 5
POOL_OFF = {"use_pool": False, "use_local_cache": False}
POOL_ONLY = {"use_pool": True, "use_local_cache": False}
LOCAL_ONLY = {"use_pool": False, "use_local_cache": True}
ROW_FIELDS = ("model", "prompt_tokens", "case", "tokens_equal", "logprobs_equal", "expected", "passed",
              "first_difference", "replica", "local_tokens", "pool_tokens", "computed_tokens", "seconds")

# Estimates (seconds) from docs/results/h200/deterministic/: the fast mode's cold prefill of the 8B shape
# is ~1.9 s at 32k and ~13 s at 128k, i.e. 1.45 x + 0.45 x^2 with x = n / 32768; the mode at grid 2048 runs
# at ~0.8x of it, the 32B shape takes ~3.3x the 8B. Decode and pool copies are rough allowances.
MODEL_FACTOR = {"qwen3-8b": 1.0, "qwen3-32b": 3.3, "tiny": 0.05}
START_S = {"qwen3-8b": 60.0, "qwen3-32b": 150.0, "tiny": 15.0}  # load two replicas, self-test, pool
DECODE_S = {"qwen3-8b": 0.02, "qwen3-32b": 0.05, "tiny": 0.01}  # per generated token at 32k
WEIGHT_BYTES = {"qwen3-8b": 16.4e9, "qwen3-32b": 65.5e9, "tiny": 0.0}


def cold_s(model: str, n: int, device: str) -> float:
    x = n / 32768
    fast = (1.45 * x + 0.45 * x * x) * MODEL_FACTOR.get(model, 3.3)
    return fast / 0.8 if device != "cpu" else fast * 20


def case_s(model: str, n: int, max_tokens: int, device: str) -> float:
    """off and prime compute the prompt; cross and local load it; four decodes of max_tokens."""
    x = max(n / 32768, 0.05)
    return 2 * cold_s(model, n, device) + 4 * max_tokens * DECODE_S.get(model, 0.05) * (0.5 + 0.5 * x) + 2 + 2 * x


def session_s(model: str, n: int, turns: int, max_tokens: int, device: str) -> float:
    return turns * (cold_s(model, n, device) + 2 * max_tokens * DECODE_S.get(model, 0.05) + 2)


def parse_pairs(text: str) -> list[tuple[str, int]]:
    """"8b:32768,32b:131072" -> [("qwen3-8b", 32768), ("qwen3-32b", 131072)]."""
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
    p.add_argument("--device", default="cuda", help="passed to kvshare up --device (cpu, cuda, cuda:N)")
    p.add_argument("--cases", default="8b:32768,8b:131072,32b:32768,32b:131072", help="MODEL:TOKENS list")
    p.add_argument("--sessions", default="8b:32768", help="MODEL:TOKENS of six-turn sessions ('' for none)")
    p.add_argument("--model", default=None, help="shorthand: --cases and --sessions MODEL:--tokens")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-tokens", type=int, default=512, help="new user ids per session turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--grid-tokens", type=int, default=None, help="default 2048 on CUDA, the chunk on CPU")
    p.add_argument("--pool-size", default=None, help="default 48GiB on CUDA, 2GiB on CPU")
    p.add_argument("--no-control", action="store_true", help="skip the flipped-byte negative control")
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds; steps that would end past it are skipped")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=19)
    args = p.parse_args(argv)
    if args.model is not None:
        pair = f"{args.model}:{args.tokens or 1024}"
        args.cases, args.sessions = pair, pair
    args.case_list, args.session_list = parse_pairs(args.cases), parse_pairs(args.sessions)
    is_cpu = args.device == "cpu"
    args.grid_tokens = args.grid_tokens or (args.chunk_tokens if is_cpu else 2048)
    args.pool_size = args.pool_size or ("2GiB" if is_cpu else "48GiB")
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


# -- comparison ------------------------------------------------------------------------------------------


def step_logprobs(choice: dict) -> list[list[float]]:
    """Per generated step: the chosen token's logprob, then the top values (sorted; text keys may collapse)."""
    lp = choice.get("logprobs") or {}
    chosen, tops = lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    return [[float(c) if c is not None else float("nan"), *sorted(map(float, (t or {}).values()), reverse=True)]
            for c, t in zip(chosen, tops)]


def compare(reference: dict, got: dict, expected: str = "equal") -> dict:
    """The exact rule of kvshare.outputs on two responses: ids, then logprobs, bit for bit."""
    from kvshare.outputs import compare_tokens

    ref_ids, ids = reference["token_ids"], got["token_ids"]
    ref_lp, lp = reference["logprobs"], got["logprobs"]
    cmp = compare_tokens(ref_ids, ids, ref_lp, candidate_top_logprobs=lp, is_exact=True)
    tokens_equal = ref_ids == ids
    logprobs_equal = len(ref_lp) == len(lp) == len(ids) and not cmp.is_logprob_divergence and (
        tokens_equal and cmp.is_identical)
    first = None
    if not (tokens_equal and logprobs_equal):
        step = cmp.divergence_step if cmp.divergence_step is not None else cmp.num_compared
        first = {"step": step, "reference_token": _at(ref_ids, step), "token": _at(ids, step),
                 "reference_logprobs": _at(ref_lp, step), "logprobs": _at(lp, step), "detail": cmp.describe()}
    is_equal = tokens_equal and logprobs_equal
    return {"tokens_equal": tokens_equal, "logprobs_equal": logprobs_equal, "first_difference": first,
            "expected": expected, "passed": is_equal if expected == "equal" else not is_equal}


def _at(seq, i):
    return seq[i] if i < len(seq) else None


# -- the service -----------------------------------------------------------------------------------------


def complete(base: str, model: str, ids: list[int], max_tokens: int, extension: dict | None, timeout_s: float) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": TOP_LOGPROBS}
    if extension is not None:
        body["kvshare"] = extension
    started = time.perf_counter()
    out = post_json(base + "/v1/completions", body, timeout_s)
    choice, p = out["choices"][0], out.get("kvshare") or {}
    return {"token_ids": [int(t) for t in choice["token_ids"]], "logprobs": step_logprobs(choice),
            "replica": p.get("replica"), "local_tokens": p.get("local_tokens"), "pool_tokens": p.get("pool_tokens"),
            "computed_tokens": p.get("computed_tokens"), "deterministic": p.get("deterministic"),
            "seconds": round(time.perf_counter() - started, 3)}


# -- the steps -------------------------------------------------------------------------------------------


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab - 4) for _ in range(n)]


def make_row(model: str, n: int, case: str, reference: dict, got: dict, expected: str = "equal") -> dict:
    row = {"model": model, "prompt_tokens": n, "case": case, **compare(reference, got, expected)}
    row.update({k: got.get(k) for k in ("replica", "local_tokens", "pool_tokens", "computed_tokens", "seconds",
                                        "deterministic")})
    row["reference_seconds"] = reference.get("seconds")
    return row


def run_case(c: UpCluster, args, model: str, n: int, rng: random.Random, vocab: int) -> list[dict]:
    a, b = c.replicas
    ids = random_ids(rng, n, vocab)
    call = lambda url, ext: complete(url, model, ids, args.max_tokens, ext, args.request_timeout)  # noqa: E731
    off = call(a, POOL_OFF)
    rows = [make_row(model, n, "prime", off, call(a, {}))]
    cross = call(b, POOL_ONLY)
    rows.append(make_row(model, n, "cross", off, cross))
    rows.append(make_row(model, n, "local", off, call(a, LOCAL_ONLY)))
    for row in rows[1:]:
        reused = (row["pool_tokens"] or 0) + (row["local_tokens"] or 0)
        if reused == 0:  # equal because nothing was reused proves nothing
            row["passed"] = False
            row["error"] = "nothing reused"
    return rows


def run_session(c: UpCluster, args, model: str, n: int, rng: random.Random, vocab: int) -> list[dict]:
    ids, rows = random_ids(rng, n, vocab), []
    for turn in range(args.turns):
        reference = complete(c.replicas[0], model, ids, args.max_tokens, POOL_OFF, args.request_timeout)
        got = complete(c.router, model, ids, args.max_tokens, None, args.request_timeout)
        row = make_row(model, len(ids), f"session_turn_{turn}", reference, got)
        row["expected_replica"] = f"replica{turn % 2}"
        if turn > 0 and not (got["pool_tokens"] or got["local_tokens"]):
            row["passed"], row["error"] = False, "a later turn reused nothing"
        rows.append(row)
        ids = ids + got["token_ids"] + random_ids(rng, args.turn_tokens, vocab)
    return rows


def run_control(c: UpCluster, args, model: str, n: int, rng: random.Random, vocab: int) -> dict:
    from kvshare.engine.presets import get_preset
    from kvshare.keys import chunk_keys
    from kvshare.layout import KVLayout
    from kvshare.pool.client import PoolClient

    a, b = c.replicas
    ids = random_ids(rng, n, vocab)
    off = complete(a, model, ids, args.max_tokens, POOL_OFF, args.request_timeout)
    complete(a, model, ids, args.max_tokens, {}, args.request_timeout)  # stores the pages
    mc = get_preset(model).config
    layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, args.chunk_tokens)
    digest = bytes.fromhex(get_json(b + "/admin/namespace")["namespace"])
    keys = chunk_keys(digest, ids, args.chunk_tokens)
    with PoolClient(c.pool_socket) as client:
        pages = client.lookup(keys, layout.page_bytes, lease=False).pages
        if len(pages) < 2:
            raise RuntimeError(f"the pool holds {len(pages)} pages of the control prompt; 2 or more needed")
        offset = 1000 * layout.itemsize + layout.itemsize - 1  # high byte (sign, exponent) of a K value, layer 0
        client.page(pages[1].offset, pages[1].page_bytes)[offset] ^= 0xFF  # chunk 1
    got = complete(b, model, ids, args.max_tokens, POOL_ONLY, args.request_timeout)
    row = make_row(model, n, "flipped_byte_control", off, got, expected="differ")
    if not got["pool_tokens"]:
        row["passed"], row["error"] = False, "the control loaded nothing from the pool"
    return row


def run_model(args, model: str, budget: Budget, out: dict, rng: random.Random) -> None:
    cases = [n for m, n in args.case_list if m == model]
    sessions = [n for m, n in args.session_list if m == model]
    longest = max([*cases, *[n + args.turns * (args.turn_tokens + args.max_tokens) for n in sessions]])
    max_model_len = -(-(longest + args.max_tokens + args.chunk_tokens) // args.chunk_tokens) * args.chunk_tokens
    too_big = memory_problem(args.device, model, max_model_len)
    if too_big:
        out["skipped"].append(f"{model}: {too_big}")
        print(f"skip {model}: {too_big}", flush=True)
        return
    if not budget.allows(f"{model} cluster start", START_S.get(model, 150.0) + (case_s(model, min(cases), args.max_tokens, args.device) if cases else 0), out["skipped"]):
        return
    vocab = get_preset(model).config.vocab_size if model in ALIASES.values() else 32000
    replica_args = ["--chunk-tokens", str(args.chunk_tokens), "--grid-tokens", str(args.grid_tokens),
                    "--max-model-len", str(max_model_len), "--verify-rate", "0"]
    cluster = UpCluster(["--deterministic", "--model", model, "--device", args.device, "--policy", "round_robin",
                         "--pool-size", args.pool_size, *[f"--replica-arg={a}" for a in replica_args]])
    started = time.monotonic()
    try:
        cluster.start(timeout_s=max(600.0, START_S.get(model, 150.0) * 3))
        out["clusters"].append({"model": model, "command": cluster.command, "start_s": round(time.monotonic() - started, 1),
                                "max_model_len": max_model_len})
        steps = [(f"{model} case {n}", case_s(model, n, args.max_tokens, args.device), run_case, n) for n in cases]
        if not args.no_control and cases:
            n = min(cases)
            steps.insert(1, (f"{model} control {n}", case_s(model, n, args.max_tokens, args.device) * 0.75, run_control, n))
        steps += [(f"{model} session {n}", session_s(model, n, args.turns, args.max_tokens, args.device), run_session, n)
                  for n in sessions]
        for name, needs_s, step, n in steps:
            if not budget.allows(name, needs_s, out["skipped"]):
                continue
            t0 = time.monotonic()
            try:
                rows = step(cluster, args, model, n, rng, vocab)
            except Exception as exc:
                traceback.print_exc()
                out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            rows = rows if isinstance(rows, list) else [rows]
            out["rows"] += rows
            out["steps"].append({"step": name, "estimate_s": round(needs_s, 1), "seconds": round(time.monotonic() - t0, 1)})
            for r in rows:
                print(format_row(r), flush=True)
    except Exception as exc:
        traceback.print_exc()
        out["errors"].append(f"{model} cluster: {type(exc).__name__}: {exc}")
    finally:
        cluster.stop()


def get_preset(model: str):
    from kvshare.engine.presets import get_preset as preset

    return preset(model)


def memory_problem(device: str, model: str, max_model_len: int) -> str | None:
    """Why two replicas of ``model`` do not fit ``device`` (kvshare up puts both there), or None."""
    if device == "cpu" or model not in WEIGHT_BYTES:
        return None
    import torch

    mc = get_preset(model).config
    kv = max_model_len * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 2
    need = 2 * (WEIGHT_BYTES[model] + kv) + 6e9  # two replicas, their KV, activations and CUDA contexts
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if need > free:
        return (f"two replicas need ~{need / 1e9:.0f} GB on {device} ({WEIGHT_BYTES[model] / 1e9:.1f} GB weights and "
                f"{kv / 1e9:.1f} GB KV each), {free / 1e9:.0f} GB free: kvshare up places every replica on --device")
    return None


def format_row(r: dict) -> str:
    diff = r["first_difference"]
    where = "-" if diff is None else f"step {diff['step']}: {diff['reference_token']} vs {diff['token']}"
    return (f"{r['model']:<10} {r['prompt_tokens']:>7} {r['case']:<22} tokens_equal={r['tokens_equal']!s:<5} "
            f"logprobs_equal={r['logprobs_equal']!s:<5} expected={r['expected']:<6} "
            f"{'PASS' if r['passed'] else 'FAIL'} pool={r['pool_tokens']} local={r['local_tokens']} "
            f"replica={r['replica']} {where}{' (' + r['error'] + ')' if r.get('error') else ''}")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    budget, rng = Budget(args.time_budget), random.Random(args.seed)
    out = {"settings": {k: v for k, v in vars(args).items() if k not in ("case_list", "session_list")},
           "rows": [], "steps": [], "clusters": [], "skipped": [], "errors": []}
    models = list(dict.fromkeys(m for m, _ in [*args.case_list, *args.session_list]))
    for model in models:
        run_model(args, model, budget, out, rng)
    out["passed"] = bool(out["rows"]) and all(r["passed"] for r in out["rows"]) and not out["errors"]
    out["seconds"] = round(time.monotonic() - budget.started, 1)
    path = os.path.join(args.out, "deterministic_service.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}: {len(out['rows'])} rows, passed {out['passed']}, skipped {len(out['skipped'])}, "
          f"errors {len(out['errors'])}, {out['seconds']} s", flush=True)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
