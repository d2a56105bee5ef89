"""A discrete-event replay of the CPU routing sweep's trace against two modelled replicas, for pool_aware's queue
term: which estimate of the wait ranks replicas best for p99 TTFT. Simulated time; no process, no timing.

Run from the tree's root: ``PYTHONPATH=$PWD python docs/results/2026-12-05-4279970-routing-cpu-queue/queue_sim.py``

The model, fitted to the 0acdc18 sweep's records (least squares of each request's time on its replica against
its computed, loaded and generated tokens; per replay the fits spread 0.2-1.0 ms per computed token and 12-34 ms
per generated token):

- the trace: ``kvshare bench routing --scale 0.1 --sessions 12 --prompts 4 --turns 3`` (kvshare.bench.routing_trace),
  each session's next turn sent when its last answer is in; a prompt is its system prompt, the turns before it
  and its user turn (+120 tokens of template for the first, +30 a turn after);
- a replica serves one request at a time in arrival order: (30 ms + 0.45 ms per computed token + 0.12 ms per
  token loaded from the pool + 18 ms per generated token) x f, f lognormal (sigma 0.25) per request;
- its local cache: an LRU of 8 chunks of 256 tokens (16 MiB of the tiny preset's KV), a prompt's chunks inserted
  tail first; the pool holds every chunk; the router learns the replicas' rates exactly but not their noise.

Policies (what each one's T_r counts as the queue; all add the load and prefill of the request itself):

    round_robin       in turn
    count_x_mean      requests in flight x the replica's moving mean service time, every chunk sent credited,
                      exact ties only (pool_aware at 572cc9e)
    backlog_progress  the sum of the expected work of the requests in flight, less the time the one being served
                      has had (825695d)
    backlog           the same, the one being served counted whole (4279970)
    backlog_tie_cap   backlog, T_r within 5% a tie taken in turn, and a sent chunk credited only below the learned
                      depth (4279970 as a whole)

Prints, per rate and policy, over 150 replications of 3 runs: the median (10th-90th percentile) of the p99 TTFT of
later turns and of first turns, and the mean TTFT.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict

import numpy as np

from kvshare.bench.routing_trace import RoutingConfig, make_trace, scaled
from kvshare.router.backlog import Backlog
from kvshare.router.pool_aware import NEAR_TIE, rank
from kvshare.router.sent_memory import SentMemory

CHUNK, CACHE_CHUNKS = 256, 8
OVERHEAD_S, PREFILL_S, LOAD_S, DECODE_S, NOISE = 0.03, 0.45e-3, 0.12e-3, 0.018, 0.25
POLICIES = ("round_robin", "count_x_mean", "backlog_progress", "backlog", "backlog_tie_cap")

TRACE = make_trace(
    RoutingConfig(
        num_sessions=12,
        num_prompts=4,
        num_turns=3,
        system_tokens=scaled((4000, 6000), 0.1),
        user_tokens=scaled((200, 1200), 0.1),
        answer_tokens=scaled((100, 300), 0.1),
        conditions=("round_robin/on",),
    )
)


def prompt_chunks(session, turn: int) -> tuple[int, list[bytes]]:
    """(prompt tokens, its full chunks' keys): the system prompt's chunks are shared by its sessions."""
    system = TRACE.system_tokens[session.prompt]
    n = system + session.user_tokens[0] + 120
    for t in range(1, turn + 1):
        n += session.answer_tokens[t - 1] + session.user_tokens[t] + 30
    keys = [
        f"p{session.prompt}/{k}".encode() if (k + 1) * CHUNK <= system else f"s{session.index}/{k}".encode()
        for k in range(n // CHUNK)
    ]
    return n, keys


def replay(policy: str, rate: float, seed: int) -> list[tuple[int, float]]:
    """(turn, TTFT) of every request of one replay."""
    rng = random.Random(seed)
    caches = [OrderedDict(), OrderedDict()]  # what each replica really holds
    sent, backlog = SentMemory(2), Backlog(2)
    free_at, mean_service, turn_of_rr = [0.0, 0.0], [0.5, 0.5], 0
    in_flight: list[list] = [[], []]  # (job, expected work, start of service)
    events = [(s.start_s / rate, 0, s.index, 0) for s in TRACE.sessions]
    heapq.heapify(events)
    out = []
    while events:
        now, kind, index, payload = heapq.heappop(events)
        if kind == 1:  # a response ended
            replica, job, service_s = payload
            backlog.finish(job)
            in_flight[replica] = [x for x in in_flight[replica] if x[0] is not job]
            mean_service[replica] += 0.2 * (service_s - mean_service[replica])
            continue
        session, turn = TRACE.sessions[index], payload
        n, keys = prompt_chunks(session, turn)
        pool_tokens = len(keys) * CHUNK
        if policy == "round_robin":
            chosen, work = turn_of_rr, [0.0, 0.0]
        else:
            times, work = [], []
            for i in range(2):
                if policy == "backlog_tie_cap":
                    gpu = sent.held_tokens(i, keys, CHUNK)
                else:
                    gpu = len(sent.depths(i, keys)) * CHUNK
                own = OVERHEAD_S + max(0, pool_tokens - gpu) * LOAD_S + (n - max(gpu, pool_tokens)) * PREFILL_S
                mean_decode = DECODE_S * 20  # the replicas' measured mean
                if policy == "count_x_mean":
                    queue = len(in_flight[i]) * mean_service[i]
                elif policy == "backlog_progress" and in_flight[i]:
                    _, head_work, head_start = in_flight[i][0]
                    queue = backlog.wait_s(i) - min(head_work, max(0.0, now - head_start))
                else:
                    queue = backlog.wait_s(i)
                times.append(queue + own)
                work.append(own + mean_decode)
            near_tie = NEAR_TIE if policy == "backlog_tie_cap" else 0.0
            chosen = rank(times, [True, True], turn_of_rr, near_tie)[0]
        turn_of_rr ^= 1
        depths = sent.depths(chosen, keys)
        sent.remember(chosen, keys)
        cache = caches[chosen]
        held = next((k for k, key in enumerate(keys) if key not in cache), len(keys)) * CHUNK
        f = rng.lognormvariate(0.0, NOISE)
        prefill_s = f * (OVERHEAD_S + max(0, pool_tokens - held) * LOAD_S + (n - max(held, pool_tokens)) * PREFILL_S)
        start = max(now, free_at[chosen])
        end = start + prefill_s + f * DECODE_S * session.answer_tokens[turn]
        free_at[chosen] = end
        job = backlog.begin(chosen, work[chosen])
        in_flight[chosen].append((job, work[chosen], start))
        sent.report(chosen, depths, held // CHUNK)
        for key in reversed(keys):
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > CACHE_CHUNKS:
            cache.popitem(last=False)
        out.append((turn, start + prefill_s - now))
        heapq.heappush(events, (end, 1, index, (chosen, job, end - start)))
        if turn + 1 < len(session.user_tokens):
            heapq.heappush(events, (end + 1e-9, 0, index, turn + 1))
    return out


def main() -> None:
    for rate in (1.0, 2.0, 4.0):
        for policy in POLICIES:
            later, first, mean = [], [], []
            for rep in range(150):
                ttfts = [x for k in range(3) for x in replay(policy, rate, 10 * rep + k)]
                later.append(np.percentile([s for t, s in ttfts if t > 0], 99))
                first.append(np.percentile([s for t, s in ttfts if t == 0], 99))
                mean.append(np.mean([s for _, s in ttfts]))
            print(
                f"{rate:g}/s {policy:17s} later p99 {np.median(later):.2f} ({np.percentile(later, 10):.2f}-"
                f"{np.percentile(later, 90):.2f})  first p99 {np.median(first):.2f} ({np.percentile(first, 10):.2f}-"
                f"{np.percentile(first, 90):.2f})  mean {np.mean(mean):.3f}"
            )


if __name__ == "__main__":
    main()
