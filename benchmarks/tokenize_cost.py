"""What tokenizing a long chat prompt costs a replica, with the presets' 131072-token BPE.

For each length: the chat (one user message of generated words, rendered with the template) encoded

    plain       one encode of the whole text (what a replica did before the piece encoder)
    first       the piece encoder on a text it never saw (pieces cut at safe points, one encode_batch), as every
                path below giving what a replica's engine takes (encode_array: one int64 array)
    first+share the same with the shared level on (kvshare up's default): the encode plus writing its pieces
    other       a text another replica on the host encoded: a second tokenizer, its own cache cold, the shared
                level (a directory under $TMPDIR, as kvshare up's) holding the pieces the first one wrote
    again       the same text again (every piece from the cache: a local hit, a retried request)
    next turn   the text with an answer and a new 256-token user turn appended (all but the tail cached)
    router      the pool_aware router's placement read of the chat (kvshare.router.pool_aware: its prompt ids and
                their chunk-hash chain), the text's pieces cached as for a prompt the router saw before

best of --repeats, wall and CPU milliseconds, against 5% of the cross-replica hit measured on the H200
(kvshare up on the H200, 8B shape: 32k 0.100 s, 128k 0.383 s, 256k 0.757 s).
Every path's ids are checked against plain.

``--fresh``: what a text request costs a fresh replica before its prefill, request by request, each replica a new
process that loads the tokenizer as ``kvshare serve`` does (the shared level on) and then, with ``warm``, runs the
request path's text warm-up (kvshare.serve.warm_path.warm_text_path). Its chat bodies (encoded as the openai SDK
does), in order:

    1st cross   a text replica A encoded (its pieces in the shared level): a fresh replica's first request
    2nd cross   another such text: the steady cross-replica hit
    miss        a text no replica encoded (every piece encoded here)
    again       the 1st text again (a local hit)

each split into the chat handler's host steps: decode (msgspec, checks), render (chat template), encode (the piece
encoder), check (the ids as one int64 array in the vocabulary); their ids equal serve's chat_prompt_ids.
``--baseline-tree DIR`` runs the same replicas on another checkout too (before/after in one run); ``--repeats``:
replicas per condition (medians summarized).

``--loop``: what the handlers' text step costs the replica's event loop. First the hop to a thread and back
(``run_in_executor``, median of 200) beside an uncached encode of 1-8 KiB of text on the loop (what
kvshare.serve.off_loop's threshold weighs); then per length, the chat handler's text step (the template rendered on
the loop, the text encoded through ``prompt_array`` as server.py does; a tree without it encodes on the loop, as its
handlers did) run beside a coroutine that wakes every millisecond, as a stream's token deltas are written: wall ms
of the step for a text encoded before (cached) and for one no replica encoded (miss), and the longest gap between
the coroutine's wake-ups while the step ran (stall: what a second stream's deltas waited; ~1 ms when nothing stalls).

    python benchmarks/tokenize_cost.py [--lengths 32768,131072,262144] [--repeats 3] [--json]
    python benchmarks/tokenize_cost.py --fresh [--baseline-tree DIR] [--lengths ...] [--json]
    python benchmarks/tokenize_cost.py --loop [--lengths ...] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

if "--replica" not in sys.argv:  # a --fresh replica imports the tree its PYTHONPATH names
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvshare.bench.workload import PromptFactory, WorkloadConfig  # noqa: E402
from kvshare.engine.loader import load_tokenizer  # noqa: E402
from kvshare.engine.token_cache import TokenCache  # noqa: E402
from kvshare.engine.token_share import SharedPieces, TokenShareConfig  # noqa: E402

H200_CROSS_S = {32768: 0.100, 131072: 0.383, 262144: 0.757}  # kvshare up, 8B shape, 2 replicas, token-id client


def best_of(fn, repeats: int, before=None) -> tuple[float, float, list[int]]:
    """(best wall ms, its CPU ms, the ids); ``before`` runs untimed ahead of each repeat."""
    best = (float("inf"), 0.0, [])
    for _ in range(repeats):
        if before is not None:
            before()
        cpu, wall = time.process_time(), time.perf_counter()
        ids = fn()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if wall * 1e3 < best[0]:
            best = (wall * 1e3, cpu * 1e3, ids)
    return best


def measure(tok, other, factory: PromptFactory, num_tokens: int, repeats: int) -> dict:
    """``other``: a second tokenizer of the same model whose shared level is the one ``tok`` writes to."""
    messages = factory.chat_messages(num_tokens, f"cost/{num_tokens}")
    turn = messages + [
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": factory.user_text(256, f"turn/{num_tokens}")},
    ]
    from kvshare.engine.tokenizer import render_chat

    text = render_chat(tok.chat_template, messages, True, bos_token="", eos_token="")
    text_turn = render_chat(tok.chat_template, turn, True, bos_token="", eos_token="")
    pieces = tok._pieces

    shared = other._pieces.shared

    def clear() -> None:
        pieces.cache = TokenCache(pieces.config.max_bytes)

    def clear_all() -> None:
        clear()
        other._pieces.cache = TokenCache(pieces.config.max_bytes)
        shutil.rmtree(shared.directory)
        os.makedirs(shared.directory, mode=0o700)
        shared.trim()

    plain = best_of(lambda: pieces.plain(text), repeats)
    first = best_of(lambda: tok.encode_array(text), repeats, before=clear)
    tok.share_pieces(shared)
    first_shared = best_of(lambda: tok.encode_array(text), repeats, before=clear_all)
    encoded = other._pieces.num_encoded
    other_seen = best_of(
        lambda: other.encode_array(text),
        repeats,
        before=lambda: setattr(other._pieces, "cache", TokenCache(pieces.config.max_bytes)),
    )
    assert other._pieces.num_encoded == encoded, "the second tokenizer encoded pieces the shared level holds"
    tok.share_pieces(None)
    again = best_of(lambda: tok.encode_array(text), repeats)
    next_turn = best_of(lambda: tok.encode_array(text_turn), repeats, before=lambda: (clear(), tok.encode(text)))
    from kvshare.router.chunk_chain import chain
    from kvshare.router.cost_model import CostModel
    from kvshare.router.pool_aware import PoolAwarePlacer

    placer = PoolAwarePlacer(2, CostModel(), feed=None, tokenizer=tok)

    def place():
        ids = placer.prompt_ids(None, messages)
        chain(ids, 256, None)
        return ids

    router = best_of(place, repeats)
    for _wall, _cpu, ids in (first, again, first_shared, other_seen):
        assert ids.tolist() == plain[2], "ids differ from plain"
    assert list(router[2]) == list(tok.apply_chat_template(messages)), "the router's ids differ from the replica's"
    assert next_turn[2].tolist() == pieces.plain(text_turn), "ids differ from plain"
    assert len(plain[2]) == num_tokens, (len(plain[2]), num_tokens)
    row = {"tokens": num_tokens, "chars": len(text), "cpus": os.cpu_count()}
    paths = (
        ("plain", plain),
        ("first", first),
        ("first_shared", first_shared),
        ("other", other_seen),
        ("again", again),
        ("next_turn", next_turn),
        ("router", router),
    )
    for name, (wall, cpu, _ids) in paths:
        row[f"{name}_ms"], row[f"{name}_cpu_ms"] = round(wall, 2), round(cpu, 2)
    if num_tokens in H200_CROSS_S:
        row["budget_ms"] = round(0.05 * H200_CROSS_S[num_tokens] * 1e3, 1)
    return row


FRESH_REQUESTS = ("1st cross", "2nd cross", "miss", "again")  # which of the 3 bodies each request sends: 0, 1, 2, 0
STEPS = ("decode", "render", "encode", "check")


def fresh_replica(model: str, bodies_path: str, share_dir: str, is_warm: bool) -> None:
    """One fresh replica's requests (runs in its own process): a JSON line of step milliseconds per request."""
    from kvshare.engine.loader import load_tokenizer
    from kvshare.engine.presets import model_config_of
    from kvshare.engine.token_share import SharedPieces, TokenShareConfig
    from kvshare.engine.tokenizer import render_chat
    from kvshare.serve import api_types as A
    from kvshare.serve.engine_request import checked_prompt_ids
    from kvshare.serve.tokenize import chat_prompt_ids

    tok = load_tokenizer(model)
    tok.share_pieces(SharedPieces(TokenShareConfig(share_dir)))  # as serve --token-cache-dir (kvshare up's default)
    vocab = model_config_of(model).vocab_size
    warmed = False
    if is_warm:
        try:
            from kvshare.serve.warm_path import warm_text_path
        except ImportError:  # a tree without the text warm-up
            pass
        else:
            warm_text_path(tok, "m")
            warmed = True
    with open(bodies_path) as f:
        bodies = [b.encode() for b in json.load(f)]
    # the chat handler's steps (a tree before chat_text/encode_array: what its apply_chat_template ran)
    render = getattr(tok, "chat_text", None) or (
        lambda m: render_chat(tok.chat_template, m, True, bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")
    )
    encode = getattr(tok, "encode_array", tok.encode)
    for name, body in zip(FRESH_REQUESTS, (bodies[0], bodies[1], bodies[2], bodies[0])):
        t = [time.perf_counter()]
        req = A.decode(body, A.ChatRequest)
        A.validate(req)
        t.append(time.perf_counter())
        text = render([{"role": m.role, "content": A.message_text(m)} for m in req.messages])
        t.append(time.perf_counter())
        ids = encode(text)
        t.append(time.perf_counter())
        array = checked_prompt_ids(ids, vocab)
        t.append(time.perf_counter())
        assert array.tolist() == list(chat_prompt_ids(tok, req.messages)), "ids differ from serve's chat path"
        row = {"request": name, "warm": warmed, "tokens": len(array)}
        row.update({f"{step}_ms": round((b - a) * 1e3, 2) for step, a, b in zip(STEPS, t, t[1:])})
        row["total_ms"] = round((t[-1] - t[0]) * 1e3, 2)
        print(json.dumps(row), flush=True)


def fresh(args, tok, factory) -> None:
    """Per length: replica A encodes two texts into a shared level, then fresh replicas (processes) send them."""
    trees = {"this": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    if args.baseline_tree:
        trees = {"baseline": os.path.abspath(args.baseline_tree), **trees}
    print(
        "tree      warm  tokens | request   | " + " ".join(f"{s:>7}" for s in (*STEPS, "total")) + " ms",
        file=sys.stderr,
    )
    for n in (int(x) for x in args.lengths.split(",")):
        work = tempfile.mkdtemp(prefix="kvshare-tokenize-fresh-")
        try:
            chats = [factory.chat_messages(n, f"fresh/{n}/{k}") for k in range(3)]
            bodies = os.path.join(work, "bodies.json")
            with open(bodies, "w") as f:  # as the openai SDK sends them (httpx: stdlib json)
                json.dump(
                    [json.dumps({"model": "m", "messages": c, "max_tokens": 16, "stream": True}) for c in chats], f
                )
            seen = os.path.join(work, "seen")
            a = load_tokenizer(args.model)  # replica A: encoded the first two texts (their cold requests)
            a.share_pieces(SharedPieces(TokenShareConfig(seen)))
            for chat in chats[:2]:
                a.apply_chat_template(chat)
            rows = []
            for tree, root in trees.items():
                # a baseline tree's warm-up had no text step: its unwarmed replica is its replica
                for is_warm in (False,) if tree == "baseline" else (False, True):
                    for k in range(args.repeats):
                        share = os.path.join(work, f"share-{tree}-{is_warm}-{k}")
                        shutil.copytree(seen, share)  # each replica meets the same shared level
                        command = [sys.executable, os.path.abspath(__file__), "--model", args.model]
                        command += ["--replica", bodies, share] + (["--warm"] if is_warm else [])
                        env = {**os.environ, "PYTHONPATH": root}
                        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
                        for line in out.splitlines():
                            rows.append(row := {"tree": tree, **json.loads(line)})
                            if args.json:
                                print(json.dumps(row), flush=True)
                                continue
                            cells = " ".join(f"{row[s + '_ms']:>7.2f}" for s in (*STEPS, "total"))
                            print(f"{tree:<9} {row['warm']!s:<5} {n:>6} | {row['request']:<9} | {cells}", flush=True)
            summarize(rows, n, args.json)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def summarize(rows: list[dict], num_tokens: int, is_json: bool) -> None:
    """Per (tree, warm): the median total of each request, the 1st cross over the 2nd (a fresh replica's first
    text request against the steady one, same run) and the 1st over 5% of the H200's cross-replica hit."""
    budget = 0.05 * H200_CROSS_S[num_tokens] * 1e3 if num_tokens in H200_CROSS_S else None
    for tree, warm in dict.fromkeys((r["tree"], r["warm"]) for r in rows):
        mine = [r for r in rows if (r["tree"], r["warm"]) == (tree, warm)]
        med = {q: statistics.median(r["total_ms"] for r in mine if r["request"] == q) for q in FRESH_REQUESTS}
        summary = {"tree": tree, "warm": warm, "tokens": num_tokens, "replicas": len(mine) // len(FRESH_REQUESTS)}
        summary |= {f"median_{q.replace(' ', '_')}_ms": round(v, 2) for q, v in med.items()}
        summary["first_over_steady"] = round(med["1st cross"] / med["2nd cross"], 2)
        if budget is not None:
            summary["budget_ms"] = round(budget, 1)
            summary["first_over_budget"] = round(med["1st cross"] / budget, 2)
        if is_json:
            print(json.dumps(summary), flush=True)
        else:
            print("  median " + ", ".join(f"{k}={v}" for k, v in summary.items()), flush=True)


def handler_encode():
    """The replica handlers' encode of a text (kvshare.serve.tokenize.prompt_array); a tree without it encodes
    on the loop, as its handlers did."""
    try:
        from kvshare.serve.tokenize import prompt_array
    except ImportError:

        async def prompt_array(tok, text: str):
            return tok.encode_array(text)

    return prompt_array


async def beside_a_stream(step) -> tuple[float, float, object]:
    """(wall ms of ``await step()``, the longest gap in ms between wake-ups of a coroutine sleeping 1 ms, the
    step's result)."""
    longest, is_done = [0.0], [False]

    async def stream() -> None:
        last = time.perf_counter()
        while not is_done[0]:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest[0], last = max(longest[0], now - last), now

    ticker = asyncio.create_task(stream())
    await asyncio.sleep(0.005)
    longest[0] = 0.0
    start = time.perf_counter()
    result = await step()
    wall = time.perf_counter() - start
    is_done[0] = True
    await ticker
    return wall * 1e3, longest[0] * 1e3, result


async def loop_costs(tok, factory: PromptFactory, lengths: list[int], repeats: int, is_json: bool) -> None:
    """The hop and short encodes, then per length the chat handler's text step beside a stream (``--loop``)."""
    loop, prompt_array = asyncio.get_running_loop(), handler_encode()
    hops = []
    for _ in range(200):
        start = time.perf_counter()
        await loop.run_in_executor(None, int)
        hops.append(time.perf_counter() - start)
    long_text = tok.chat_text(factory.chat_messages(8192, "loop/short"))
    short = {}
    for num_chars in (1024, 2048, 4096, 8192):
        short[num_chars] = best_of(lambda: tok.encode_array(long_text[:num_chars]), max(repeats, 5))[0]
    row = {"hop_median_us": round(statistics.median(hops) * 1e6, 1)}
    row |= {f"encode_{n}_chars_ms": round(ms, 3) for n, ms in short.items()}
    print(json.dumps(row) if is_json else "  " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    async def text_step(messages):
        return await prompt_array(tok, tok.chat_text(messages))  # as server.py's chat handler

    for n in lengths:
        cached, miss = (float("inf"), 0.0), (float("inf"), 0.0)
        for k in range(repeats):
            messages = factory.chat_messages(n, f"loop/{n}/{k}")  # a text this tokenizer never saw: a miss
            tok._pieces.cache = TokenCache(tok._pieces.config.max_bytes)
            wall, stall, ids = await beside_a_stream(lambda: text_step(messages))
            assert ids.tolist() == tok._pieces.plain(tok.chat_text(messages)), "ids differ from plain"
            miss = min(miss, (wall, stall))
            for _ in range(10):  # the text again: every piece from the cache (ms each, so more repeats)
                cached = min(cached, (await beside_a_stream(lambda: text_step(messages)))[:2])
        row = {"tokens": n, "cpus": os.cpu_count(), "cached_ms": round(cached[0], 2)}
        row |= {
            "cached_stall_ms": round(cached[1], 2),
            "miss_ms": round(miss[0], 2),
            "miss_stall_ms": round(miss[1], 2),
        }
        print(json.dumps(row) if is_json else "  " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b", help="preset or model directory whose tokenizer is measured")
    p.add_argument("--lengths", default="32768,131072,262144")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON line per length")
    p.add_argument("--fresh", action="store_true", help="a fresh replica's text requests, step by step")
    p.add_argument("--baseline-tree", help="with --fresh: a checkout whose replicas run the same requests too")
    p.add_argument("--loop", action="store_true", help="what the handlers' text step costs the event loop")
    p.add_argument("--replica", nargs=2, metavar=("BODIES", "SHARE_DIR"), help=argparse.SUPPRESS)
    p.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.replica:
        fresh_replica(args.model, *args.replica, args.warm)
        return 0
    tok = load_tokenizer(args.model)
    if not tok._pieces.is_splittable:
        print(f"note: this tokenizer is encoded whole ({tok._pieces.not_splittable})", file=sys.stderr)
    other = load_tokenizer(args.model)  # another replica's: its own per-process cache
    share_dir = tempfile.mkdtemp(prefix="kvshare-token-cache-")
    other.share_pieces(SharedPieces(TokenShareConfig(share_dir)))
    factory = PromptFactory(tok, WorkloadConfig(nonce="tokenize-cost"))
    if args.fresh:
        fresh(args, tok, factory)
        return 0
    if args.loop:
        asyncio.run(loop_costs(tok, factory, [int(x) for x in args.lengths.split(",")], args.repeats, args.json))
        return 0
    names = ("plain", "first", "first+share", "other", "again", "next turn", "router")
    print(
        f"{'tokens':>7} {'chars':>8} | " + " | ".join(f"{n:>15}" for n in names) + " | 5% of H200 hit   (ms: wall/cpu)",
        file=sys.stderr,
    )
    try:
        for n in (int(x) for x in args.lengths.split(",")):
            row = measure(tok, other, factory, n, args.repeats)
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            paths = ("plain", "first", "first_shared", "other", "again", "next_turn", "router")
            cells = [f"{row[k + '_ms']:>7.2f}/{row[k + '_cpu_ms']:<7.2f}" for k in paths]
            print(f"{n:>7} {row['chars']:>8} | " + " | ".join(cells) + f" | {row.get('budget_ms', '-')}", flush=True)
    finally:
        shutil.rmtree(share_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
