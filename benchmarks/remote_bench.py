"""Remote-tier benchmark: promote bandwidth (store -> arena) against plain GETs, and what it means for TTFT.

    python benchmarks/remote_bench.py                      # starts its own redis-server on loopback
    python benchmarks/remote_bench.py --remote redis://HOST:PORT --tokens 8192 --json out.json

Byte level: N pages (the tiny model's KV for ``--tokens`` tokens: 8 layers x K,V x 2 heads x 64 x fp32
= 8 KiB per token) are written through pool A and wait in the store. Then, alternating, (a) plain
pipelined GETs of exactly the same values from the same store by one redis-py client and (b) a
lookup on pool B (arena emptied before each) that promotes them: fetch, verify, copy into the arena,
re-checksum, commit, answer. Medians of ``--repeats`` of each, and their ratio.

Engine level (skip with --no-engine): the tiny model on CPU, the same prompt, time to first token
cold (engine on A computes and stores), through the store (a fresh engine on B: the lookup
promotes), and from B's arena (a second fresh engine on B).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvshare.layout import KVLayout  # noqa: E402
from kvshare.pool.checksum import page_checksum  # noqa: E402
from kvshare.pool.client import PoolClient  # noqa: E402
from kvshare.pool.remote.format import num_parts, part_keys  # noqa: E402
from kvshare.pool.spawn import running_pool  # noqa: E402
from kvshare.units import parse_size  # noqa: E402

TINY = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=256)


@contextlib.contextmanager
def redis_server_on_loopback():
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed: apt-get install redis-server, or pass --remote URL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvshare-bench-redis-")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def write_pages(client: PoolClient, keys: list[bytes], page_bytes: int) -> None:
    namespace = hashlib.blake2b(b"bench", digest_size=16).digest()
    reservation = client.reserve(namespace, keys, page_bytes)
    rng = np.random.default_rng(0)
    sums = []
    for _, offset in reservation.grants:
        view = client.page(offset, page_bytes)
        view[:] = rng.integers(0, 256, page_bytes, dtype=np.uint8)
        sums.append(page_checksum(view))
    client.commit(reservation.reservation_id, sums)


def wait_for(predicate, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError("the pool's write-behind did not finish")
        time.sleep(0.02)


def byte_level(url: str, args) -> dict:
    import redis

    page_bytes = TINY.page_bytes
    num_pages = args.tokens // TINY.chunk_tokens
    total = num_pages * page_bytes
    prefix = f"bench{os.getpid()}"
    keys = [hashlib.blake2b(f"{prefix}/{i}".encode(), digest_size=16).digest() for i in range(num_pages)]
    pool_args = ("--extent-size", "64MiB", "--remote", url, "--remote-prefix", prefix,
                 "--remote-part-size", str(args.part_size), "--remote-promote-batch", str(args.batch))
    size = str(max(256 << 20, 2 * total))
    with running_pool(size, pool_args, quiet=True) as a, running_pool(size, pool_args, quiet=True) as b, \
            PoolClient(a) as ca, PoolClient(b) as cb:
        write_pages(ca, keys, page_bytes)
        wait_for(lambda: ca.stats()["remote"]["written_pages"] == num_pages)
        store = redis.Redis.from_url(url)
        names = [k for key in keys for k in part_keys(prefix, key, num_parts(page_bytes, args.part_size))]
        batch_pages = max(1, args.batch // page_bytes)
        get_s, promote_s = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            got = 0
            per_batch = len(names) // num_pages * batch_pages
            for i in range(0, len(names), per_batch):  # the same round trips as a promotion
                pipe = store.pipeline(transaction=False)
                for name in names[i : i + per_batch]:
                    pipe.get(name)
                got += sum(len(v) for v in pipe.execute())
            get_s.append(time.perf_counter() - start)
            assert got >= total
            cb.flush()
            start = time.perf_counter()
            lease = cb.lookup(keys, page_bytes)
            promote_s.append(time.perf_counter() - start)
            assert lease.num_pages == num_pages, f"promoted {lease.num_pages} of {num_pages} pages"
            cb.release([lease.lease_id], wait=True)
        start = time.perf_counter()
        lease = cb.lookup(keys, page_bytes)  # now in B's arena: the local lookup and lease
        local_lookup_s = time.perf_counter() - start
        cb.release([lease.lease_id], wait=True)
        remote = cb.stats()["remote"]
        assert remote["discarded_checksum"] == 0 and remote["promoted_pages"] == num_pages * args.repeats
    get_med, promote_med = statistics.median(get_s), statistics.median(promote_s)
    return {
        "tokens": args.tokens, "pages": num_pages, "page_bytes": page_bytes, "bytes": total,
        "part_bytes": args.part_size, "batch_bytes": args.batch, "repeats": args.repeats,
        "get_s": get_s, "promote_s": promote_s,
        "get_gbps": total / get_med / 1e9, "promote_gbps": total / promote_med / 1e9,
        "promote_vs_get": get_med / promote_med, "local_lookup_ms": local_lookup_s * 1e3,
    }


def engine_level(url: str, args) -> dict:
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine, RequestOptions, SamplingParams

    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prefix = f"benchengine{os.getpid()}"
    pool_args = ("--extent-size", "64MiB", "--remote", url, "--remote-prefix", prefix)
    text = "".join(chr(32 + (i * 7919) % 95) for i in range(args.tokens + 1))  # byte tokens: +1 leaves a tail

    def ttft(engine, ids, options=RequestOptions()):
        start = time.perf_counter()
        events = engine.generate(ids, params, options)
        first = next(events)
        elapsed = time.perf_counter() - start
        rest = [first.token_id] + [e.token_id for e in events]
        return elapsed, rest, first.provenance

    with running_pool("512MiB", pool_args, quiet=True) as a, running_pool("512MiB", pool_args, quiet=True) as b, \
            PoolClient(a) as ca:
        config = dict(model="tiny", max_model_len=args.tokens + 64, local_cache_bytes=0)
        engine_a = Engine(EngineConfig(pool_socket=a, **config))
        ids = engine_a.tokenizer.encode(text)
        cold_s, cold_ids, _ = ttft(engine_a, ids)
        num_chunks = len(ids) // TINY.chunk_tokens
        wait_for(lambda: ca.stats()["remote"]["written_pages"] == num_chunks)
        engine_a.close()
        engine_b = Engine(EngineConfig(pool_socket=b, **config))
        remote_s, remote_ids, remote_prov = ttft(engine_b, ids)
        engine_b.close()
        engine_b2 = Engine(EngineConfig(pool_socket=b, **config))
        local_s, local_ids, local_prov = ttft(engine_b2, ids)
        engine_b2.close()
    assert remote_ids == cold_ids == local_ids, "reuse changed the output"
    return {"prompt_tokens": len(ids), "cold_ttft_s": cold_s, "remote_ttft_s": remote_s,
            "remote_pool_tokens": remote_prov.pool_tokens, "arena_ttft_s": local_s,
            "arena_pool_tokens": local_prov.pool_tokens}


def report(result: dict) -> str:
    b = result["bytes_level"]
    mib = b["bytes"] / (1 << 20)
    lines = [
        f"remote tier, {b['pages']} pages of {b['page_bytes'] >> 20} MiB = {mib:.0f} MiB "
        f"(tiny model, {b['tokens']} tokens), parts of {b['part_bytes'] >> 20} MiB, {b['repeats']} repeats, medians",
        f"  plain pipelined GETs      {b['get_gbps']:.2f} GB/s  ({statistics.median(b['get_s']) * 1e3:.0f} ms)",
        f"  promote (store -> arena)  {b['promote_gbps']:.2f} GB/s  ({statistics.median(b['promote_s']) * 1e3:.0f} ms)",
        f"  promote / GET             {b['promote_vs_get']:.2f}",
        f"  lookup once in the arena  {b['local_lookup_ms']:.2f} ms",
    ]
    if "engine_level" in result:
        e = result["engine_level"]
        lines += [
            f"engine (tiny, CPU), prompt of {e['prompt_tokens']} tokens, time to first token:",
            f"  cold prefill              {e['cold_ttft_s']:.2f} s",
            f"  through the store         {e['remote_ttft_s']:.2f} s  ({e['remote_pool_tokens']} tokens promoted)",
            f"  from B's arena            {e['arena_ttft_s']:.2f} s  ({e['arena_pool_tokens']} tokens from the pool)",
            f"  cold / through the store  {e['cold_ttft_s'] / e['remote_ttft_s']:.1f}x",
        ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--remote", default=None, help="the store to use (default: start a redis-server on loopback)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt length: the bytes moved are 8 KiB per token")
    p.add_argument("--part-size", type=parse_size, default="8MiB")
    p.add_argument("--batch", type=parse_size, default="64MiB", help="pages per round trip (--remote-promote-batch)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-engine", action="store_true", help="skip the engine-level TTFT runs")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    server = contextlib.nullcontext(args.remote) if args.remote else redis_server_on_loopback()
    with server as url:
        result = {"bytes_level": byte_level(url, args)}
        if not args.no_engine:
            result["engine_level"] = engine_level(url, args)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
