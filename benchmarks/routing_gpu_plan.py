"""Sizes and durations of `kvshare bench routing` on a GPU, from its flags, before any GPU is lent (pure but main).

    python benchmarks/routing_gpu_plan.py [bench routing flags ...] [--gpu-memory-gb 80 --replicas-per-gpu 2 ...]

Sizes come from the trace (``make_trace(...).working_set_tokens()``) and the model's shape, as `bench routing`
sizes its cluster (kvshare.commands.bench_routing.routing_plan): each replica's local cache is the working set over
--gpu-share, the pool --pool-share times it. Per GPU: the replicas' weights, their local caches, the sequence KV the
built-in engine preallocates on CUDA (its --max-model-len, from --replica-arg), and --activations-gb each.

Durations replay the trace in a model of the built-in engine: each replica serves one request at a time, first
come first served (kvshare.serve.worker), and a request costs

    overhead + computed tokens / prefill rate + loaded tokens x KV bytes per token / load bandwidth
             + answer tokens x decode step

With ``--engine vllm`` the replicas batch: a replica's prefills still run one after another (first come first
served, the time to first token as above), but a request's decode runs beside the others' (vLLM's continuous
batching with chunked prefill), each of its steps the batched step (--decode-step-ms, the step of a full batch
on a shared card: an upper bound at lower loads). vLLM's KV cache is the local cache (--kv-cache-memory-bytes),
so a replica's memory is its weights, that KV and its activations (CUDA graphs, the profile's buffers).

Two bounds, placed round robin in send order: ``cold`` computes every prompt token (nothing reused: what
round_robin/off approaches); ``reuse`` computes only what no earlier request held (the system prompt once, then
each turn's new tail; the rest loaded from the pool: what a perfect placement over the pool approaches). Replicas
that share a GPU are charged the prefill as if the other were always computing too (rate / replicas per GPU), and a
decode step in full (batch-1 decode steps are bound by launch overhead and weight reads, which two streams overlap):
an upper bound on a shared GPU's durations.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Rates:
    """The 8B shape on one H100, as assumed (see the defaults' sources in main's help)."""

    prefill_tokens_per_s: float = 25000.0
    decode_step_s: float = 0.012
    load_bytes_per_s: float = 50e9
    overhead_s: float = 0.03  # per request: HTTP, chat template, tokenizing, router hop, the publish's last wait
    replicas_per_gpu: int = 2
    kv_bytes_per_token: int = 147456  # the 8B shape's
    is_batched: bool = False  # vLLM: decodes run beside each other, only prefills queue


def weights_bytes(mc) -> int:
    """A decoder's parameter bytes (bf16/fp16: 2 a parameter) from its shape."""
    attention = mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    mlp = 3 * mc.hidden_size * mc.intermediate_size
    embeddings = mc.vocab_size * mc.hidden_size * (1 if mc.tie_word_embeddings else 2)
    itemsize = 4 if mc.dtype == "float32" else 2
    return (mc.num_layers * (attention + mlp) + embeddings) * itemsize


def longest_sequence(trace) -> int:
    """The most tokens one request of the trace holds: its prompt and its answer."""
    return max(trace.system_tokens[s.prompt] + sum(s.user_tokens) + sum(s.answer_tokens) for s in trace.sessions)


def replay_seconds(trace, rate: float, rates: Rates, num_replicas: int, reuse: bool) -> tuple[float, float]:
    """(the replay's duration, its TTFT p99) at ``rate`` sessions/s in the engine model above."""
    free = [0.0] * num_replicas
    arrivals = [(s.start_s / rate, s.index, 0) for s in trace.sessions]
    heapq.heapify(arrivals)
    prompts_seen: set[int] = set()
    sent, end, ttfts = 0, 0.0, []
    prefill_s = rates.replicas_per_gpu / rates.prefill_tokens_per_s
    while arrivals:
        at, index, turn = heapq.heappop(arrivals)
        s = trace.sessions[index]
        system = trace.system_tokens[s.prompt]
        prompt = system + sum(s.user_tokens[: turn + 1]) + sum(s.answer_tokens[:turn])
        held = 0
        if reuse:  # whole 256-token chunks of what an earlier request held
            before = system + sum(s.user_tokens[:turn]) + sum(s.answer_tokens[: turn - 1]) if turn else 0
            held = max(before, system if s.prompt in prompts_seen else 0) // 256 * 256
        prompts_seen.add(s.prompt)
        replica = sent % num_replicas
        sent += 1
        start = max(at, free[replica])
        load_s = held * rates.kv_bytes_per_token / rates.load_bytes_per_s
        first = start + rates.overhead_s + (prompt - held) * prefill_s + load_s
        done = first + s.answer_tokens[turn] * rates.decode_step_s
        free[replica] = first if rates.is_batched else done  # batched: the next prefill need not wait the decode
        end = max(end, done)
        ttfts.append(first - at)
        if turn + 1 < len(s.user_tokens):
            heapq.heappush(arrivals, (done, index, turn + 1))
    ttfts.sort()
    return end, ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]


def plan(argv: list[str]) -> str:
    """The sizes and the durations, as text, for `bench routing` flags ``argv`` and the estimate's own flags."""
    from kvshare.bench.routing_trace import make_trace, parse_condition
    from kvshare.cli import build_parser
    from kvshare.commands.bench_routing import routing_plan
    from kvshare.engine.presets import model_config_of

    p = argparse.ArgumentParser(prog="routing_gpu_plan.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill-rate", type=float, default=25000.0, help="tokens/s (8B, 4-16k, H100: assumed)")
    p.add_argument(
        "--decode-step-ms",
        type=float,
        default=None,
        help="a decode step (8B, CUDA graphs): 12 for one request (built-in), 25 for vLLM's batch of up to "
        "32 on a card shared by two replicas (assumed)",
    )
    p.add_argument("--load-gbps", type=float, default=50.0, help="pool -> GPU (8B shape, H100: 48-54 measured)")
    p.add_argument("--overhead-ms", type=float, default=30.0)
    p.add_argument("--replicas-per-gpu", type=int, default=2)
    p.add_argument("--gpu-memory-gb", type=float, default=80.0)
    p.add_argument("--host-memory-gib", type=float, default=128.0)
    p.add_argument("--activations-gb", type=float, default=3.0, help="per replica: CUDA context, prefill buffers")
    p.add_argument(
        "--cluster-start-s",
        type=float,
        default=None,
        help="pool, replicas, routers, warm-up: 90 built-in (assumed); 140 vLLM (measured on one H100: the two 8B "
        "replicas of a card start together with torch.compile and CUDA graphs, their KV given; warm-up, checks)",
    )
    own, bench = p.parse_known_args(argv)
    args = build_parser().parse_args(["bench", "routing", *bench])
    config, target = routing_plan(args)
    if own.decode_step_ms is None:
        own.decode_step_ms = 25.0 if target.engine == "vllm" else 12.0
    if own.cluster_start_s is None:
        own.cluster_start_s = 140.0 if target.engine == "vllm" else 90.0
    mc = model_config_of(target.model)
    trace = make_trace(config)
    longest = longest_sequence(trace)
    is_vllm = target.engine == "vllm"
    max_len = target.max_model_len or next(
        (int(a.split("=", 1)[1]) for a in target.replica_args if a.startswith("--max-model-len=")),
        mc.max_position_embeddings,
    )
    sequence_kv = 0 if is_vllm else max_len * mc.kv_bytes_per_token  # vLLM's sequences live in its KV cache
    per_replica = weights_bytes(mc) + target.local_cache_bytes + sequence_kv + own.activations_gb * GB
    per_gpu = per_replica * own.replicas_per_gpu
    pool_gib = target.pool_bytes / 2**30
    working_set = trace.working_set_tokens()
    lines = [
        f"trace: {config.num_sessions} sessions, {config.num_prompts} prompts of {config.system_tokens} tokens, "
        f"{config.num_turns} turns (user {config.user_tokens}, answers {config.answer_tokens}); "
        f"{trace.num_requests} requests, {sum(sum(s.answer_tokens) for s in trace.sessions)} answer tokens, "
        f"longest request {longest} tokens",
        f"working set {working_set} tokens = {working_set * mc.kv_bytes_per_token / GB:.1f} GB; local cache "
        f"{target.local_cache_bytes / GB:.1f} GB a replica; pool {target.pool_bytes / GB:.1f} GB "
        f"({pool_gib:.1f} GiB, {pool_gib / own.host_memory_gib:.0%} of {own.host_memory_gib:g} GiB host memory)",
        f"a {target.engine} replica: weights {weights_bytes(mc) / GB:.1f} GB + "
        + ("vLLM's KV cache" if is_vllm else "local cache")
        + f" + sequence KV {sequence_kv / GB:.1f} GB (max-model-len {max_len}) + {own.activations_gb:g} GB = "
        f"{per_replica / GB:.1f} GB; {own.replicas_per_gpu} a GPU: {per_gpu / GB:.1f} of {own.gpu_memory_gb:g} GB"
        + ("" if per_gpu <= own.gpu_memory_gb * GB else "  ** DOES NOT FIT **")
        + ("" if max_len >= longest else f"  ** max-model-len below the longest request ({longest}) **"),
        f"assumed: prefill {own.prefill_rate:g} tokens/s, decode step {own.decode_step_ms:g} ms "
        f"({'batched: decodes run beside each other' if is_vllm else 'one request at a time'}), load "
        f"{own.load_gbps:g} GB/s, {own.overhead_ms:g} ms a request, cluster start {own.cluster_start_s:g} s",
    ]
    if is_vllm and max_len * mc.kv_bytes_per_token > target.local_cache_bytes:
        lines.append(f"  ** vLLM's KV cache holds less than one request of --max-model-len {max_len} **")
    rates = Rates(
        own.prefill_rate,
        own.decode_step_ms / 1e3,
        own.load_gbps * GB,
        own.overhead_ms / 1e3,
        own.replicas_per_gpu,
        mc.kv_bytes_per_token,
        is_batched=is_vllm,
    )
    conditions = [parse_condition(name) for name in config.conditions]
    total = own.cluster_start_s * config.num_runs
    for rate in config.rates:
        cold = replay_seconds(trace, rate, rates, target.num_replicas, reuse=False)
        warm = replay_seconds(trace, rate, rates, target.num_replicas, reuse=True)
        each = [cold[0] if not c.use_pool or not c.is_shared else (cold[0] + warm[0]) / 2 for c in conditions]
        total += sum(each) * config.num_runs
        lines.append(
            f"rate {rate:g}/s: a replay {warm[0]:.0f}-{cold[0]:.0f} s (TTFT p99 {warm[1]:.2f}-{cold[1]:.2f} s, "
            f"reuse-cold bounds); {len(conditions)} conditions ~{sum(each):.0f} s"
        )
    lines.append(f"this command: ~{total:.0f} s ({total / 60:.1f} min) for {config.num_runs} run(s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    print(plan(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
