"""benchmarks/vllm_gpu.py's modes for loads that start before vLLM schedules a request and never stall the others.

  ttft-routed  per length, fresh prompts, each a session of three turns through `kvshare up`'s router (policy
               alternate: turn k on replica k mod 2): A computes it cold, B takes it across replicas (the router's
               prefetch hint goes ahead of it where hints are on: --hints), A again (its own prefix hit). Token-id
               prompts (the same prompt each turn: B's greedy tokens against A's cold run) and chat prompts (each
               turn the conversation so far: B loads turn 0's prompt, as a next turn on another replica does; a
               message of ~0.9 x the length's tokens: the row's cached tokens say how many).
  stall        --streams decode streams on replica B (EOS ignored); their gaps alone, then while B loads a prefix A
               computed (the others run: the load runs beside them; the row counts B's asynchronous loads), then the
               same prompt again (B's own prefix hit: what vLLM's front end and step cost beside the streams with
               no load), then while B computes a prompt nobody holds (vLLM's chunked prefill). One row: each
               phase's worst gap over the p99 without (goal <= 2).

Plain urllib and threads, as vllm_gpu_client.py (no vLLM import).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid

import vllm_gpu_client as client

from kvshare.integrations.vllm import gpu_rows


def add_hint_mode_arguments(p) -> None:
    """The flags of these modes, and of the kvshare setup's router (its policy, its hints)."""
    p.add_argument("--policy", default="alternate", help="kvshare: kvshare up's --policy (ttft-routed: alternate)")
    p.add_argument("--hints", choices=("on", "off"), default="on", help="kvshare: the router's prefetch hints")
    p.add_argument("--prompt-kinds", nargs="+", choices=("ids", "chat"), default=["ids", "chat"])
    p.add_argument("--streams", type=int, default=8, help="stall: decode streams on replica B")
    p.add_argument("--stream-tokens", type=int, default=4096, help="stall: each stream's max_tokens")
    p.add_argument("--baseline-s", type=float, default=4.0, help="stall: the streams alone this long")
    p.add_argument("--no-stall-cold", dest="stall_cold", action="store_false", help="stall: no cold phase")


class Streams:
    """``len(prompts)`` greedy streams on ``url``, started at once, each token's arrival time (perf_counter)."""

    def __init__(self, url: str, model: str, prompts: list[list[int]], max_tokens: int) -> None:
        self.arrivals: list[list[float]] = [[] for _ in prompts]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._read, args=(url, model, prompt, max_tokens, times), daemon=True)
            for prompt, times in zip(prompts, self.arrivals)
        ]
        for thread in self._threads:
            thread.start()

    def _read(self, url: str, model: str, prompt: list[int], max_tokens: int, times: list[float]) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
        body["ignore_eos"] = True
        req = urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=900) as resp:
            for raw in resp:
                if raw.startswith(b"data: {"):
                    times.append(time.perf_counter())
                if self._stop.is_set():
                    return  # the connection closes: vLLM aborts the stream

    def wait_started(self, num_tokens: int = 20, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while min(len(t) for t in self.arrivals) < num_tokens:
            if time.monotonic() > deadline:
                raise RuntimeError("the decode streams did not start")
            time.sleep(0.05)

    def stop(self) -> list[list[float]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        return [list(times) for times in self.arrivals]


def stream_chat(url: str, model: str, messages: list[dict], max_tokens: int, headers: dict) -> tuple:
    """One streamed greedy chat completion: (its Completion as vllm_gpu_client's, the answer's text)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    started, ttft, cached, text = time.perf_counter(), None, None, []
    with urllib.request.urlopen(req, timeout=900) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(content)
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if ttft is None:
        raise RuntimeError(f"{url} streamed no content")
    return gpu_rows.Completion(ttft, (), (), (), cached), "".join(text)


def chat_text(run, length: int) -> str:
    """A user message of about 0.9 x ``length`` tokens (room for the conversation's next turns within
    max-model-len): random ids of the model's vocabulary, decoded, cut to the share whose text encodes to that
    many (decoded random ids encode to another number of ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.args.model_dir)
    ids, wanted = run.prompt(length), int(length * 0.9)
    num_encoded = len(tokenizer(tokenizer.decode(ids)).input_ids)
    return tokenizer.decode(ids[: max(1, len(ids) * wanted // num_encoded)])


def mode_ttft_routed(run) -> None:
    a = run.args
    for kind in a.prompt_kinds:
        for length in a.lengths:
            for _ in range(a.prompts):
                turns = _chat_turns(run, length) if kind == "chat" else _id_turns(run, length)
                cold, cross, local = turns
                row = gpu_rows.ttft_row(
                    **run.base_row(),
                    prompt_tokens=length,
                    engine="kvshare",
                    cold=cold,
                    cross=cross,
                    local=local,
                    kv_bytes_per_token=run.per_token,
                    h2d_bytes_per_s=run.h2d,
                    first_request=run.first,
                    local_kind="vllm-prefix-cache (A, turn 2)",
                )
                if kind == "chat":  # each turn is another prompt: no token comparison
                    row |= {"tokens_equal": None, "first_divergence": None, "logprobs_equal": None}
                run.rows.add({"mode": "ttft-routed", "prompt_kind": kind, "hints": a.hints, "policy": a.policy, **row})
                run.first = False


def _id_turns(run, length: int) -> list:
    """One token-id prompt three times in one session (alternate: A, B, A)."""
    prompt, headers = run.prompt(length), {"X-Session-ID": uuid.uuid4().hex}
    turns = []
    for _ in range(3):
        turns.append(client.stream_completion(run.router, run.served, prompt, run.args.max_tokens, 900, headers))
        time.sleep(run.args.settle_s)
    return turns


def _chat_turns(run, length: int) -> list:
    """A conversation of three turns (alternate by its assistant messages: A, B, A), each the one before and more."""
    messages, headers, turns = [{"role": "user", "content": chat_text(run, length)}], {}, []
    for follow_up in ("Go on.", "And then?", None):
        done, answer = stream_chat(run.router, run.served, messages, run.args.max_tokens, headers)
        turns.append(done)
        if follow_up is not None:
            messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
        time.sleep(run.args.settle_s)
    return turns


# kvshare's connector counters on a vLLM replica's /metrics that tell how a load ran (absent with LMCache)
LOAD_COUNTERS = {
    "async_loads": "vllm:kvshare_async_loads_total",
    "loaded_tokens": "vllm:kvshare_loaded_tokens_total",
    "prefetch_hits": "vllm:kvshare_prefetch_hits_total",
}


def mode_stall(run) -> None:
    a = run.args
    a_url, b_url = run.urls
    for length in a.lengths:
        prompt = run.prompt(length)
        run.complete(a_url, prompt, 1)  # A computes and stores it
        time.sleep(a.settle_s)
        baseline = _phase(run, b_url, lambda: time.sleep(a.baseline_s))
        seen = [client.counters(b_url, LOAD_COUNTERS)]  # B's counters before the load, after it, after the local hit
        load = _phase(run, b_url, lambda: run.complete(b_url, prompt, 1))
        seen.append(client.counters(b_url, LOAD_COUNTERS))
        local = _phase(run, b_url, lambda: run.complete(b_url, prompt, 1))  # B holds it now: vLLM's own hit
        seen.append(client.counters(b_url, LOAD_COUNTERS))
        counters = {phase: _changes(seen[i], seen[i + 1]) for i, phase in enumerate(("load", "local"))}
        cold = _phase(run, b_url, lambda: run.complete(b_url, run.prompt(length), 1)) if a.stall_cold else None
        row = gpu_rows.stall_row(
            **run.base_row(),
            prompt_tokens=length,
            engine="lmcache-mp" if a.setup == "lmcache-mp" else "kvshare",
            baseline=(baseline[0], baseline[1], baseline[1] + a.baseline_s),
            load=load,
            cold=cold,
            local=local,
            counters={phase: changes for phase, changes in counters.items() if changes},
        )
        run.rows.add(row)


def _changes(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How each counter read both times changed between them."""
    return {name: after[name] - before[name] for name in after if name in before}


def _phase(run, url: str, request) -> tuple:
    """Decode streams on ``url`` while ``request()`` runs: (their token times, when it was sent, its result)."""
    a = run.args
    streams = Streams(url, run.served, [run.prompt(256) for _ in range(a.streams)], a.stream_tokens)
    try:
        streams.wait_started()
        sent = time.perf_counter()
        result = request()
        time.sleep(1.0)  # the streams go on past the request's first token
    finally:
        arrivals = streams.stop()
    return arrivals, sent, result
