"""Which kvshare files a KV load into vLLM on CPU runs code in, from the scheduler taking the request in to its
first token.

The sibling of ``request_path.py`` (the built-in engine) for vLLM with kvshare's connector: a pool daemon and
two vLLM OpenAI servers on CPU (the tiny preset as a model directory, ``kvshare.integrations.vllm.launch``), A
and B, both with the connector. Measured:

    cold   A, a prompt nobody has seen: computed, its chunks stored into the pool
    load   B, the same prompt: its chunks leased from the pool and loaded into vLLM's blocks

Each is preceded by one request of the same kind on another prompt, so the measured one finds every lazy
set-up done (``--first`` measures the first ones instead). A vLLM server runs its engine core (the
connector's scheduler side) and its worker (the worker side) in processes of their own, so the hook is in
every process of the server: ``vllm_path_hook/sitecustomize.py``, first in the servers' PYTHONPATH, records
every call of a kvshare function with its time, thread and process, and the moment vLLM's scheduler takes in a
sampled token (``Scheduler.update_from_output``). The window opens at the connector's first call for the
request (``on_new_request``, from vLLM's ``Scheduler.add_request``: the scheduler takes the request in) and
closes when the scheduler takes in its first token; what the connector does with the step's report and the
request's end (``update_connector_output``, ``request_finished``) comes after it. Threads beside the request
(the pool link's watcher, the hint listener) are counted where they ran in the window, and named. The pool
daemon runs in its own process: not counted.

    PYTHONPATH=$PWD python benchmarks/vllm_load_path.py [--vllm-python /work/.venv-vllm/bin/python]
        [--tokens 2048] [--first] [--functions] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import kvshare

ROOT = os.path.dirname(os.path.abspath(kvshare.__file__)) + os.sep
HOOK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_path_hook")
WINDOW_OPENS = "on_new_request"  # vLLM's Scheduler.add_request calls it
FIRST_TOKEN = "<first token>"


def read_records(events_dir: str) -> list[list]:
    """Every record of every process of one server, in time order: [t, file, function, thread, process]."""
    records = []
    for name in os.listdir(events_dir):
        with open(os.path.join(events_dir, name)) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return sorted(records, key=lambda r: r[0])


def window(records: list[list], sent_at: float) -> dict:
    """The files run from the connector's first call for the request sent at ``sent_at`` to its first token."""
    opens = next((r[0] for r in records if r[0] >= sent_at and r[2].endswith(WINDOW_OPENS)), None)
    if opens is None:
        raise RuntimeError("the connector was not asked about the request (is the hook in the servers' path?)")
    closes = next((r[0] for r in records if r[0] >= opens and r[1] == FIRST_TOKEN), None)
    if closes is None:
        raise RuntimeError("no first token was recorded after the request was scheduled")
    files: dict[str, set[str]] = defaultdict(set)
    functions: dict[str, set[str]] = defaultdict(set)
    for t, name, function, thread, process in records:
        if opens <= t <= closes and name != FIRST_TOKEN:
            files[name].add(f"{process}/{thread}")
            functions[name].add(function)
    before: dict[str, set[str]] = defaultdict(set)
    for t, name, function, thread, process in records:
        if sent_at <= t < opens and name != FIRST_TOKEN:
            before[name].add(f"{process}/{thread}: {function}")
    return {
        "files": {k: sorted(v) for k, v in sorted(files.items())},
        "functions": {k: sorted(v) for k, v in sorted(functions.items())},
        "window_s": closes - opens,
        # kvshare functions run between the request's sending and the scheduler taking it in, by file
        "before_window": {k: sorted(v) for k, v in sorted(before.items())},
    }


def server_spec(name: str, model: str, socket_path: str, vllm_python: str, events_dir: str, max_len: int):
    """The launch spec of one replica with the connector and the hook in every process of it."""
    from kvshare.integrations.vllm.bench import free_port
    from kvshare.integrations.vllm.launch import LaunchSpec, VllmServerConfig, vllm_server_command

    config = VllmServerConfig(
        model=model,
        port=free_port(),
        pool_socket=socket_path,
        python=vllm_python,
        replica=name,
        dtype="float32",
        max_model_len=max_len,
    )
    spec = vllm_server_command(config)
    env = dict(spec.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HOOK_DIR, env.get("PYTHONPATH", "")) if p)
    env.update(KVSHARE_PATH_EVENTS=events_dir, KVSHARE_PATH_ROOT=ROOT)
    return LaunchSpec(spec.argv, env, spec.base_url)


def send(spec, served: str, prompt: list[int]) -> tuple[float, int]:
    """The request, and the monotonic time it was sent at; returns (sent_at, cached tokens vLLM reported)."""
    from kvshare.integrations.vllm.bench import first_token_seconds

    sent_at = time.monotonic()
    _, cached = first_token_seconds(spec.base_url, served, prompt)
    time.sleep(1.0)  # the hook's writer appends every 0.2 s
    return sent_at, cached


def measure(vllm_python: str, num_tokens: int, is_first: bool) -> dict:
    from kvshare.integrations.vllm.bench import _make_tiny_model, _stop
    from kvshare.integrations.vllm.launch import wait_until_ready
    from kvshare.pool.spawn import start_pool

    work = tempfile.mkdtemp(prefix="kvshare-vllm-path-")
    model = _make_tiny_model(os.path.join(work, "model"))
    socket_path = os.path.join(work, "pool.sock")
    pool = start_pool(socket_path, "1GiB", (), stdout=subprocess.DEVNULL)
    procs, events = {}, {}
    try:
        for name in ("A", "B"):
            events[name] = os.path.join(work, f"events-{name}")
            spec = server_spec(name, model, socket_path, vllm_python, events[name], num_tokens + 64)
            log = open(os.path.join(work, f"vllm-{name}.log"), "w")
            proc = subprocess.Popen(
                spec.argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            procs[name] = (proc, spec)
        for proc, spec in procs.values():
            wait_until_ready(spec.base_url, proc, timeout_s=600)
        served = os.path.basename(os.path.normpath(model))
        rng = random.Random(0)
        if not is_first:
            warm = [rng.randrange(256) for _ in range(num_tokens)]
            send(procs["A"][1], served, warm)
            send(procs["B"][1], served, warm)
        prompt = [rng.randrange(256) for _ in range(num_tokens)]
        sent_a, _ = send(procs["A"][1], served, prompt)
        sent_b, cached_b = send(procs["B"][1], served, prompt)
        cold = window(read_records(events["A"]), sent_a)
        loaded = window(read_records(events["B"]), sent_b)
    except BaseException:
        for name in procs:
            with open(os.path.join(work, f"vllm-{name}.log"), errors="replace") as f:
                print(f"--- vllm-{name}.log ---\n{''.join(f.readlines()[-30:])}", file=sys.stderr)
        raise
    finally:
        _stop(procs, pool)
        shutil.rmtree(work, ignore_errors=True)
    if cached_b <= 0:
        raise RuntimeError("replica B reported no cached tokens: the load was not measured")
    return {
        "prompt_tokens": num_tokens,
        "is_first": is_first,
        "cold": cold,
        "load": loaded,
        "cached_tokens_b": cached_b,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default="/work/.venv-vllm/bin/python", help="the vLLM venv's python")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (whole chunks are shared)")
    parser.add_argument("--first", action="store_true", help="measure each replica's first request")
    parser.add_argument("--functions", action="store_true", help="list the functions run in each file")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the lists")
    args = parser.parse_args()
    result = measure(args.vllm_python, args.tokens, args.first)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"B loaded {result['cached_tokens_b']} of {args.tokens} prompt tokens (vLLM's cached_tokens)")
    for case in ("cold", "load"):
        files = result[case]["files"]
        window_ms = result[case]["window_s"] * 1000
        print(f"{case}: {len(files)} kvshare files in {window_ms:.0f} ms (taken in by the scheduler -> first token)")
        for name, where in files.items():
            print(f"  {name:45s} {', '.join(where)}")
            if args.functions:
                print(f"      {', '.join(result[case]['functions'][name])}")
        if result[case]["before_window"]:
            print("  between the request's sending and the scheduler taking it in:")
            for name, calls in result[case]["before_window"].items():
                print(f"    {name:43s} {', '.join(calls)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
