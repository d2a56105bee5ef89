"""The weights' content fingerprint: first hash against `cat FILES > /dev/null`, and the cached restart.

    python3 benchmarks/identity_hash.py --model DIR              # any local model directory
    python3 benchmarks/identity_hash.py --preset tiny --work DIR # make-model writes the preset there first

For each page-cache state (``warm``: the files in memory; ``cold``: their pages dropped with
posix_fadvise DONTNEED before each run, no root needed) it times, as medians of --repeats runs:
``cat`` of the weights files, the first kvshare.identity.model_fingerprint (a fresh, empty digest
cache each run, hashing on all cores) and their ratio (the goal is <= 1.3); then the restart: the
same call with the digest cache filled (a stat and a cache read per file; the goal is < 50 ms).
Prints a table and one JSON line (--json-out FILE writes it too).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvshare.identity import WEIGHT_SUFFIXES, model_fingerprint  # noqa: E402


def drop_pages(paths: list[str]) -> None:
    """Evict the files' clean pages from the page cache (what a freshly booted host would read)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a file just written) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn, paths: list[str], cold: bool, repeats: int) -> float:
    times = []
    fn()  # a first run: the warm state's page cache holds the files after it
    for _ in range(repeats):
        if cold:
            drop_pages(paths)
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def first_hash(model_dir: str) -> None:
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-cache-") as cache:
        os.environ["XDG_CACHE_HOME"] = cache  # an empty digest cache: the hash a first start pays
        model_fingerprint(model_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a local model directory")
    p.add_argument("--preset", help="a kvshare preset, written by make-model into --work first (if absent)")
    p.add_argument("--work", default=None, help="where --preset is written (default: a temporary directory)")
    p.add_argument("--device", default="cpu", help="device make-model builds the preset on (cuda for the GPU presets)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--states", default="warm,cold", help="page-cache states to measure: warm, cold or both")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if bool(args.model) == bool(args.preset):
        p.error("give one of --model DIR and --preset NAME")
    model_dir = args.model
    if args.preset:
        model_dir = os.path.join(args.work or tempfile.mkdtemp(prefix="kvshare-bench-"), args.preset)
        if not os.path.exists(os.path.join(model_dir, "config.json")):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvshare",
                    "make-model",
                    args.preset,
                    "--out",
                    model_dir,
                    "--device",
                    args.device,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
    files = sorted(f for f in glob.glob(os.path.join(model_dir, "*")) if f.endswith(WEIGHT_SUFFIXES))
    num_bytes = sum(os.path.getsize(f) for f in files)
    result = {"model": model_dir, "files": len(files), "bytes": num_bytes, "cores": os.cpu_count(), "states": {}}
    cat = ["cat", *files]
    for state in args.states.split(","):
        cold = state == "cold"
        cat_s = timed(lambda: subprocess.run(cat, check=True, stdout=subprocess.DEVNULL), files, cold, args.repeats)
        hash_s = timed(lambda: first_hash(model_dir), files, cold, args.repeats)
        result["states"][state] = {
            "cat_s": cat_s,
            "first_hash_s": hash_s,
            "ratio": hash_s / cat_s,
            "hash_gb_s": num_bytes / hash_s / 1e9,
            "cat_gb_s": num_bytes / cat_s / 1e9,
        }
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-cache-") as cache:
        os.environ["XDG_CACHE_HOME"] = cache
        model_fingerprint(model_dir)  # fills the cache, as the first start did
        restarts = []
        for _ in range(20):
            started = time.perf_counter()
            model_fingerprint(model_dir)
            restarts.append(time.perf_counter() - started)
    result["restart_ms"] = statistics.median(restarts) * 1e3
    print(f"{model_dir}: {len(files)} files, {num_bytes / 1e9:.2f} GB, {os.cpu_count()} cores")
    for state, r in result["states"].items():
        print(
            f"  {state:4}  cat {r['cat_s']:.3f} s ({r['cat_gb_s']:.2f} GB/s)  first hash {r['first_hash_s']:.3f} s "
            f"({r['hash_gb_s']:.2f} GB/s)  hash/cat {r['ratio']:.2f}"
        )
    print(f"  restart (digests cached): {result['restart_ms']:.2f} ms")
    print(json.dumps(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
