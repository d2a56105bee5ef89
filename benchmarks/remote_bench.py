"""Remote-tier benchmark: promote bandwidth (store -> arena) against raw-socket GETs, and what it means for TTFT.

    python benchmarks/remote_bench.py                      # starts its own redis-server (and a 3-node cluster)
    python benchmarks/remote_bench.py --json               # one JSON line of figures on stdout
    python benchmarks/remote_bench.py --remote redis://HOST:PORT --tokens 8192 --json-out out.json

Byte level: N pages (the tiny model's KV for ``--tokens`` tokens: 8 layers x K,V x 2 heads x 64 x fp32
= 8 KiB per token) are written through pool A and wait in the store. Then, per repeat and back to
back, (a) one pipelined GET of exactly the same values from the same server on a plain socket, its
replies read into one buffer and not parsed (the ceiling of any client), (b) a lookup on pool B
(arena emptied before each) that promotes them: fetch, verify, land in the arena, commit, answer,
and (c) the same GETs through redis-py (last: its freed bytes objects slowed what came right after).
The pools' arenas are faulted in at start (``--prefault``, as in a pool that has served a while); one
untimed round, then medians of ``--repeats``; the ratio is the median of the repeats' raw-GET / promote
ratios. Then the promotion again from a cluster of ``--cluster-nodes`` primaries on loopback (one
machine: the nodes share its cores with the pools).

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


def free_port(pair: bool = False) -> int:
    """A free loopback port; with ``pair`` one whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not pair:
            return port
        if port <= 55535:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def _start_redis(port: int, workdir: str, cluster: bool) -> subprocess.Popen:
    cmd = [
        "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
    ]
    if cluster:
        cmd += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    for _ in range(500):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"redis-server on port {port} did not start")


@contextlib.contextmanager
def redis_on_loopback(num_nodes: int = 1):
    """One redis-server (num_nodes 1) or a cluster of num_nodes primaries on loopback ports; yields the URL."""
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed: apt-get install redis-server, or pass --remote URL")
    workdir = tempfile.mkdtemp(prefix="kvshare-bench-redis-")
    cluster = num_nodes > 1
    procs = []
    try:
        ports = [free_port(pair=cluster) for _ in range(num_nodes)]
        procs = [_start_redis(port, workdir, cluster) for port in ports]
        if not cluster:
            yield f"redis://127.0.0.1:{ports[0]}"
            return
        nodes = [f"127.0.0.1:{p}" for p in ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=60,
        )
        for _ in range(500):
            info = [
                subprocess.run(["redis-cli", "-p", str(p), "cluster", "info"], capture_output=True, text=True).stdout
                for p in ports
            ]
            if all("cluster_state:ok" in i for i in info):
                break
            time.sleep(0.05)
        yield "redis+cluster://" + ",".join(nodes)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def raw_get_seconds(url: str, names: list[str]) -> float:
    """One pipelined GET of ``names`` on a plain socket, every reply read into one buffer (no parsing)."""
    import redis

    host, port = url.removeprefix("redis://").split(":")
    lengths = redis.Redis(host=host, port=int(port)).pipeline(transaction=False)
    for name in names:
        lengths.strlen(name)
    expect = sum(len(b"$%d\r\n" % n) + n + 2 for n in lengths.execute())
    request = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(n), n.encode()) for n in names)
    buffer = memoryview(bytearray(expect))
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        sock.sendall(request)
        got = 0
        while got < expect:
            got += sock.recv_into(buffer[got:])
        return time.perf_counter() - start


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


def byte_level(url: str, args, with_gets: bool = True) -> dict:
    """Promote the same pages ``args.repeats`` times; alternating with raw-socket and redis-py GETs of them."""
    import redis

    page_bytes = TINY.page_bytes
    num_pages = args.tokens // TINY.chunk_tokens
    total = num_pages * page_bytes
    prefix = f"bench{os.getpid()}"
    keys = [hashlib.blake2b(f"{prefix}/{i}".encode(), digest_size=16).digest() for i in range(num_pages)]
    # --prefault: the arena's pages are faulted in, as in a pool that has served a while
    pool_args = (
        "--extent-size",
        "64MiB",
        "--prefault",
        "--remote",
        url,
        "--remote-prefix",
        prefix,
        "--remote-part-size",
        str(args.part_size),
        "--remote-promote-batch",
        str(args.batch),
        "--remote-readers",
        str(args.readers),
    )
    size = str(max(256 << 20, 2 * total))
    with (
        running_pool(size, pool_args, quiet=True) as a,
        running_pool(size, pool_args, quiet=True) as b,
        PoolClient(a) as ca,
        PoolClient(b) as cb,
    ):
        write_pages(ca, keys, page_bytes)
        wait_for(lambda: ca.stats()["remote"]["written_pages"] == num_pages)
        names = [k for key in keys for k in part_keys(prefix, key, num_parts(page_bytes, args.part_size))]
        store = redis.Redis.from_url(url) if with_gets else None
        raw_s, get_s, promote_s = [], [], []
        for repeat in range(-1, args.repeats):  # an untimed round first: connections opened, caches warm
            if with_gets:  # raw GET and promotion back to back: the pair of the ratio
                raw_s.append(raw_get_seconds(url, names))
            cb.flush()
            start = time.perf_counter()
            lease = cb.lookup(keys, page_bytes)
            promote_s.append(time.perf_counter() - start)
            assert lease.num_pages == num_pages, f"promoted {lease.num_pages} of {num_pages} pages"
            cb.release([lease.lease_id], wait=True)
            if with_gets:  # last: its 64 MiB of freed bytes objects slowed a promotion right after it
                start = time.perf_counter()
                pipe = store.pipeline(transaction=False)
                for name in names:
                    pipe.get(name)
                assert sum(len(v) for v in pipe.execute()) >= total
                get_s.append(time.perf_counter() - start)
            if repeat < 0:
                del raw_s[:], get_s[:], promote_s[:]
        start = time.perf_counter()
        lease = cb.lookup(keys, page_bytes)  # now in B's arena: the local lookup and lease
        local_lookup_s = time.perf_counter() - start
        cb.release([lease.lease_id], wait=True)
        remote = cb.stats()["remote"]
        assert remote["discarded_checksum"] == 0 and remote["promoted_pages"] == num_pages * (args.repeats + 1)
    out = {
        "tokens": args.tokens,
        "pages": num_pages,
        "page_bytes": page_bytes,
        "bytes": total,
        "part_bytes": args.part_size,
        "batch_bytes": args.batch,
        "readers": args.readers,
        "repeats": args.repeats,
        "promote_s": promote_s,
        "promote_gb_s": total / statistics.median(promote_s) / 1e9,
        "local_lookup_ms": local_lookup_s * 1e3,
        "store_bytes_per_s": remote["store_bytes_per_s"],
    }
    if with_gets:
        out |= {
            "raw_get_s": raw_s,
            "redispy_get_s": get_s,
            "raw_get_gb_s": total / statistics.median(raw_s) / 1e9,
            "redispy_get_gb_s": total / statistics.median(get_s) / 1e9,
            # per repeat, raw GET and promotion measured back to back: the median of those pairs' ratios
            "promote_ratio_vs_raw_get": statistics.median(r / p for r, p in zip(raw_s, promote_s)),
            "promote_ratio_vs_redispy_get": statistics.median(g / p for g, p in zip(get_s, promote_s)),
        }
    return out


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

    with (
        running_pool("512MiB", pool_args, quiet=True) as a,
        running_pool("512MiB", pool_args, quiet=True) as b,
        PoolClient(a) as ca,
    ):
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
    return {
        "prompt_tokens": len(ids),
        "cold_ttft_s": cold_s,
        "remote_ttft_s": remote_s,
        "remote_pool_tokens": remote_prov.pool_tokens,
        "arena_ttft_s": local_s,
        "arena_pool_tokens": local_prov.pool_tokens,
    }


def report(result: dict) -> str:
    b = result["bytes_level"]
    mib = b["bytes"] / (1 << 20)
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    lines = [
        f"remote tier, {b['pages']} pages of {b['page_bytes'] >> 20} MiB = {mib:.0f} MiB (tiny model, {b['tokens']} "
        f"tokens), parts of {b['part_bytes'] >> 20} MiB, batches of {b['batch_bytes'] >> 20} MiB, "
        f"{b['readers']} readers, "
        f"{b['repeats']} repeats, medians; {result['cores']} cores, load {result['load']:.1f}",
        f"  raw-socket pipelined GET  {b['raw_get_gb_s']:.2f} GB/s  ({ms(b['raw_get_s']):.0f} ms)",
        f"  redis-py pipelined GET    {b['redispy_get_gb_s']:.2f} GB/s  ({ms(b['redispy_get_s']):.0f} ms)",
        f"  promote (store -> arena)  {b['promote_gb_s']:.2f} GB/s  ({ms(b['promote_s']):.0f} ms)",
        f"  promote / raw GET         {b['promote_ratio_vs_raw_get']:.2f}  (redis-py GET: "
        f"{b['promote_ratio_vs_redispy_get']:.2f})",
        f"  lookup once in the arena  {b['local_lookup_ms']:.2f} ms",
    ]
    if "cluster" in result:
        c = result["cluster"]
        lines.append(
            f"  promote, {c['nodes']}-node cluster  {c['promote_gb_s']:.2f} GB/s  ({ms(c['promote_s']):.0f} ms): "
            f"{c['promote_gb_s'] / b['promote_gb_s']:.2f}x one node"
        )
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


def summary(result: dict) -> dict:
    """The one-line figures of --json."""
    b = result["bytes_level"]
    out = {
        k: b[k]
        for k in (
            "raw_get_gb_s",
            "redispy_get_gb_s",
            "promote_gb_s",
            "promote_ratio_vs_raw_get",
            "bytes",
            "page_bytes",
            "batch_bytes",
            "readers",
            "repeats",
        )
    }
    out |= {"cores": result["cores"], "load": round(result["load"], 2)}
    if "cluster" in result:
        out |= {
            "cluster_promote_gb_s": result["cluster"]["promote_gb_s"],
            "cluster_nodes": result["cluster"]["nodes"],
            "cluster_ratio_vs_one_node": result["cluster"]["promote_gb_s"] / b["promote_gb_s"],
        }
    else:
        out["cluster_promote_gb_s"] = None
    if "engine_level" in result:
        out |= {k: result["engine_level"][k] for k in ("cold_ttft_s", "remote_ttft_s", "arena_ttft_s")}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--remote", default=None, help="the store to use (default: start a redis-server on loopback)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt length: the bytes moved are 8 KiB per token")
    p.add_argument("--part-size", type=parse_size, default="8MiB")
    p.add_argument("--batch", type=parse_size, default="16MiB", help="pages per round trip (--remote-promote-batch)")
    p.add_argument("--readers", type=int, default=2, help="--remote-readers of the pools")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--cluster-nodes", type=int, default=3, help="promote from a cluster of this many too (0: skip)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine-level TTFT runs")
    p.add_argument("--json", action="store_true", help="print one JSON line of figures (the report goes to stderr)")
    p.add_argument("--json-out", default=None, help="also write every figure and sample to this file")
    args = p.parse_args()
    result: dict = {"cores": os.cpu_count(), "load": os.getloadavg()[0]}
    server = contextlib.nullcontext(args.remote) if args.remote else redis_on_loopback(1)
    with server as url:
        result["bytes_level"] = byte_level(url, args)
        if not args.no_engine:
            result["engine_level"] = engine_level(url, args)
    if args.cluster_nodes > 1 and not args.remote:
        with redis_on_loopback(args.cluster_nodes) as url:
            result["cluster"] = {"nodes": args.cluster_nodes, **byte_level(url, args, with_gets=False)}
    print(report(result), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary(result)))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
