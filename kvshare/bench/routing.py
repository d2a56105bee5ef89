"""The routing workload (``kvshare bench routing``): one trace replayed through every policy's router.

For each run (a fresh RoutingCluster), each rate (ascending) and each condition (in an order rotated by
the run, so no condition always goes first), the trace (kvshare.bench.routing_trace) is replayed with
content of its own: every prompt carries a tag of (run, rate, condition), so no replay finds another's
prefixes (what earlier replays left in the caches is only evicted). Same trace, same seeds, same lengths
and arrivals under every condition.

Results (the folder given by --out)::

    records.jsonl   every request (kvshare.bench.records.Record; its timeline says when the replica wrote the
                    first token: the router's added latency is the client's TTFT minus that)
    routing.jsonl   one row per replay (kvshare.bench.routing_summary.replay_row), with the replicas' pool bytes
                    loaded, the router's fallbacks and its KV events' lag sampled over the replay
    runs.jsonl      the command, the commit, the hardware, the sizes, the config and the run numbers of each
                    invocation (written before its first replay)
    summary.json, routing.md   per (rate, condition) over every run in the folder, with bootstrap intervals

Invocations may share a folder (kvshare.bench.routing_results): runs are numbered on from the folder's last
(or from ``first_run``), and the report is rebuilt from every invocation's rows after each replay.

After each replay the last turns of ``num_verify`` sessions are sent again to the replica that served them
with the pool and its local cache off; their outputs must equal the measured ones (no wrong KV under any
policy, the events-dropped control included). vLLM replicas batch requests, so a recompute may part from the
measured output by batch effects: each comparison is reported by the gap rule (kvshare.outputs: equal, or
where they part, the step and the top-2 logprob gap there), never a failed run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass

from kvshare.bench.client import BenchRequest
from kvshare.bench.records import Record, ResultsDir, describe_host, tree_commit
from kvshare.bench.routing_cluster import EVENTS_LIVE, REPLICA_EVENTS_LIVE, RoutingCluster, RoutingTarget
from kvshare.bench.routing_results import EXPERIMENT, ROWS, check_same_workload, next_run, write_summary
from kvshare.bench.routing_summary import replay_row
from kvshare.bench.routing_trace import Condition, RoutingConfig, SessionPlan, Trace, make_trace, parse_condition
from kvshare.bench.runner import BenchContext, mark_matches
from kvshare.stats import histogram_quantile

LAG_POLL_S = 0.25
POOL_BYTES_LOADED = "kvshare_pool_bytes_loaded_total"  # a built-in replica's
VLLM_POOL_BYTES_LOADED = "vllm:kvshare_load_bytes_total"  # a vLLM replica's connector's (kvshare.integrations.vllm)
FALLBACKS = "kvshare_router_pool_aware_fallbacks_total"
SEND_DELAY = "kvshare_router_send_delay_seconds"  # the router's histogram of its own time before a request is sent
EVENT_LAG = "kvshare_router_kv_events_lag_seconds"
POOL_AWARE_TERM = "kvshare_router_pool_aware_"  # its cost-term gauges, one per replica (router.metrics)
HINTS_SENT = "kvshare_router_prefetch_hints_total"  # the router's prefetch hints (outcome label summed: sent too)
PREFETCH_HITS = "vllm:kvshare_prefetch_hits_total"  # pages a vLLM replica's loads took from copies ahead
PREFETCHED = "vllm:kvshare_prefetched_pages_total"  # pages a vLLM replica copied ahead on hints


@dataclass
class Replayer:
    """What every replay of one run uses."""

    ctx: BenchContext
    cluster: RoutingCluster
    trace: Trace
    config: RoutingConfig

    async def replay(self, condition: Condition, rate: float, run: int) -> tuple[list[Record], dict]:
        """The trace at ``rate`` sessions/s through ``condition``'s router: its records and its row."""
        key = f"{EXPERIMENT}/rate={rate:g}/{condition.name}/run={run}"
        url = self.cluster.url(condition.router)
        before = await self._counters(url)
        delay_before = await self._buckets(url, SEND_DELAY)
        pool_before = await asyncio.to_thread(self.cluster.pool_counters)
        lag: list[float] = []
        live: list[bool] = []
        replicas_live: list[float] = []
        poll = (
            asyncio.create_task(self._sample_lag(url, lag, live, replicas_live))
            if condition.router.startswith("pool_aware")
            else None
        )
        started = time.perf_counter()
        try:
            sessions = await asyncio.gather(
                *(self._session(p, condition, rate, run, key, url) for p in self.trace.sessions)
            )
        finally:
            if poll is not None:
                poll.cancel()
        wall_s = time.perf_counter() - started
        delay = [
            (le, n - delay_before.get(le, 0.0)) for le, n in sorted((await self._buckets(url, SEND_DELAY)).items())
        ]
        records = [r for session_records, _ in sessions for r in session_records]
        records += await self._verify(sessions, condition, run, key)
        after = await self._counters(url)
        pool_after = await asyncio.to_thread(self.cluster.pool_counters)
        fallbacks = after[1] - before[1] if after[1] is not None and before[1] is not None else None
        row = replay_row(key, rate, condition.name, run, records, wall_s, after[0] - before[0], fallbacks, lag)
        row["pool_counters"] = {k: v - pool_before.get(k, 0) for k, v in pool_after.items()}
        row["router_send_p99_s"] = histogram_quantile(0.99, delay)  # the replay's requests, by the router's buckets
        row["events_live_share"] = sum(live) / len(live) if live else None
        # the share of replicas whose own KV events the router trusted, over the samples (None: it reads none)
        row["replica_events_live_share"] = sum(replicas_live) / len(replicas_live) if replicas_live else None
        # prefetch hints: the router's, every outcome (a hinted condition's); the pages the replicas copied ahead on
        # hints and those their loads took from the copies meanwhile (whatever router sent the hints)
        row["hints"], row["prefetched_pages"], row["prefetch_hits"] = (after[k] - before[k] for k in (2, 3, 4))
        if condition.router.startswith("pool_aware"):
            row["pool_aware_terms"] = await self._pool_aware_terms(url)
        return records, row

    async def _session(
        self, plan: SessionPlan, condition: Condition, rate: float, run: int, key: str, url: str
    ) -> tuple[list[Record], tuple[BenchRequest, Record] | None]:
        """One session's turns in order, each sent when the last answer is in; a failed turn ends the session."""
        await asyncio.sleep(plan.start_s / rate)
        factory, tag = self.ctx.factory, f"{self.ctx.run_id}/{key}"
        session_id = f"{tag}/s{plan.index}"
        system_tag = f"{tag}/system{plan.prompt}"
        system_tokens = self.trace.system_tokens[plan.prompt]
        body = factory.user_text(system_tokens, system_tag)
        history, records, last = [], [], None
        for turn, (num_user, num_answer) in enumerate(zip(plan.user_tokens, plan.answer_tokens)):
            head = factory.header(system_tag if condition.is_shared else f"{session_id}/t{turn}")
            user = {"role": "user", "content": factory.user_text(num_user, f"{session_id}/{turn}")}
            messages = [{"role": "system", "content": head + body}, *history, user]
            request = BenchRequest(
                url,
                "chat",
                self.ctx.model,
                messages=messages,
                max_tokens=num_answer,
                use_pool=condition.use_pool,
                session_id=session_id,
                engine=self.cluster.target.engine,
            )
            record, response = await self.ctx.exchange(
                request,
                experiment=EXPERIMENT,
                unit=key,
                condition=condition.name,
                role="measure",
                context_tokens=system_tokens,
                session=plan.index,
                turn=turn,
                placement=condition.router,
                block=run,
            )
            records.append(record)
            if not record.is_ok:
                break
            history += [user, {"role": "assistant", "content": response.text}]
            last = (request, record)
        return records, last

    async def _verify(self, sessions, condition: Condition, run: int, key: str) -> list[Record]:
        """Last turns sent again to the replica that served them, recomputed: outputs must be equal."""
        out = []
        lasts = [last for _, last in sessions if last is not None][: self.config.num_verify]
        for request, measured in lasts:
            replica = self.cluster.replica_url(measured.replica)
            if replica is None:
                continue
            # vLLM's prefix cache has no per-request switch: a salt of the request's own keys it apart from every
            # block cached (and the pool's namespace with it), so vLLM computes the whole prompt again
            salt = f"verify-{uuid.uuid4().hex}" if request.engine == "vllm" else None
            again = dataclasses.replace(request, url=replica, use_pool=False, use_local_cache=False, cache_salt=salt)
            verify = await self.ctx.measure(
                again,
                experiment=EXPERIMENT,
                unit=key,
                condition=condition.name,
                role="verify",
                context_tokens=measured.context_tokens,
                session=measured.session,
                turn=measured.turn,
                placement=condition.router,
                block=run,
            )
            mark_matches([measured], verify)
            out.append(verify)
        return out

    async def _counters(self, router_url: str) -> tuple[float, float | None, float, float, float]:
        """(pool bytes the replicas loaded, the router's pool_aware fallbacks or None, its prefetch hints, pages the
        replicas copied ahead, pages their loads took from those copies) so far."""
        loaded = prefetched = hits = 0.0
        for url in self.cluster.replica_urls:
            metrics = await self._metrics(url)
            loaded += metrics.get(POOL_BYTES_LOADED, 0.0) + metrics.get(VLLM_POOL_BYTES_LOADED, 0.0)
            prefetched += metrics.get(PREFETCHED, 0.0)
            hits += metrics.get(PREFETCH_HITS, 0.0)
        router = await self._metrics(router_url)
        return loaded, router.get(FALLBACKS), router.get(HINTS_SENT, 0.0), prefetched, hits

    async def _pool_aware_terms(self, router_url: str) -> dict[str, dict[str, float]]:
        """pool_aware's cost terms per replica as the router measured them by the end of a replay (its gauges
        kvshare_router_pool_aware_*: seconds per prefill and per loaded token, service, overhead, samples)."""
        terms: dict[str, dict[str, float]] = {}
        for sample in await self._samples(router_url):
            if sample.name.startswith(POOL_AWARE_TERM) and "replica" in sample.labels:
                terms.setdefault(sample.labels["replica"], {})[sample.name.removeprefix(POOL_AWARE_TERM)] = sample.value
        return terms

    async def _buckets(self, url: str, name: str) -> dict[float, float]:
        """A histogram of ``url``'s /metrics: its cumulative count per upper bound (+Inf included)."""
        return {float(s.labels["le"]): s.value for s in await self._samples(url) if s.name == name + "_bucket"}

    async def _metrics(self, url: str) -> dict[str, float]:
        """Each metric of ``url``'s /metrics, summed over its labels."""
        sums: dict[str, float] = {}
        for sample in await self._samples(url):
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        return sums

    async def _samples(self, url: str) -> list:
        from prometheus_client.parser import text_string_to_metric_families

        async with self.ctx.session.get(url + "/metrics") as resp:
            text = await resp.text()
        return [sample for family in text_string_to_metric_families(text) for sample in family.samples]

    async def _sample_lag(
        self, router_url: str, lags: list[float], live: list[bool], replicas_live: list[float]
    ) -> None:
        """Every LAG_POLL_S: whether the router trusts the pool's events, the share of replicas whose own events
        it trusts (where it reads them), and the last batch's lag when one arrived (the gauge reads 0 before any
        batch: not a lag)."""
        seen = None
        num_replicas = len(self.cluster.replica_urls)
        while True:
            metrics = await self._metrics(router_url)
            is_live, lag = metrics.get(EVENTS_LIVE) == 1.0, metrics.get(EVENT_LAG)
            live.append(is_live)
            if REPLICA_EVENTS_LIVE in metrics:
                replicas_live.append(metrics[REPLICA_EVENTS_LIVE] / num_replicas)
            if lag is not None and (is_live or lag > 0) and lag != seen:  # each batch's lag once
                lags.append(lag)
                seen = lag
            await asyncio.sleep(LAG_POLL_S)


def kv_bytes_per_token(model: str) -> int:
    from kvshare.engine.presets import model_config_of

    return model_config_of(model).kv_bytes_per_token


def run_routing(
    config: RoutingConfig,
    target: RoutingTarget,
    out_dir: str,
    command: str,
    tokenizer: str | None = None,
    timeout_s: float = 600.0,
    on_replay=None,
    first_run: int | None = None,
) -> tuple[list[dict], str]:
    """Every run, rate and condition; (the summary of every run in ``out_dir``, the report's path).

    Runs are numbered from ``first_run`` (None: after the folder's last); the number picks the condition order.
    ``on_replay(row)`` after each replay."""
    results = ResultsDir(out_dir)
    if first_run is None:
        first_run = next_run(results)
    if first_run < 0:
        raise ValueError("the first run's number must be >= 0")
    runs = range(first_run, first_run + config.num_runs)
    trace = make_trace(config)
    conditions = [parse_condition(name) for name in config.conditions]
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    meta = _run_meta(config, target, trace, run_id, command, runs)
    check_same_workload(results, meta)
    results.log_run(meta)  # before the first replay: a command cut short still names what wrote its rows

    def replayed(row: dict) -> None:  # the report is rewritten after every replay: a run cut short keeps one
        write_summary(results)
        if on_replay is not None:
            on_replay(row)

    for run in runs:
        order = conditions[run % len(conditions) :] + conditions[: run % len(conditions)]
        with RoutingCluster(target, tuple(c.router for c in conditions)) as cluster:
            asyncio.run(
                _run_one(
                    config,
                    cluster,
                    trace,
                    order,
                    run,
                    run_id,
                    results,
                    tokenizer or target.model,
                    timeout_s,
                    replayed,
                )
            )
    return write_summary(results)


def _run_meta(
    config: RoutingConfig, target: RoutingTarget, trace: Trace, run_id: str, command: str, runs: range
) -> dict:
    """What runs.jsonl says of one command: the workload, the cluster, the host and the tree that measured it."""
    sizes = (
        f"{config.num_sessions} sessions over {config.num_prompts} system prompts of {config.system_tokens} "
        f"tokens, {config.num_turns} turns (user {config.user_tokens}, answers {config.answer_tokens} tokens); "
        f"working set {trace.working_set_tokens()} tokens; {target.num_replicas} {target.engine} replicas of "
        f"{target.model} on {target.device}, local cache {target.local_cache_bytes >> 20} MiB each, pool "
        f"{target.pool_bytes >> 20} MiB"
    )
    return {
        "run_id": run_id,
        "experiment": EXPERIMENT,
        "command": command,
        "commit": tree_commit(),
        "hardware": describe_host(),
        "sizes": sizes,
        "num_runs": config.num_runs,
        "runs": list(runs),
        "config": dataclasses.asdict(config),
        "target": dataclasses.asdict(target),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


async def _run_one(config, cluster, trace, order, run, run_id, results, tokenizer, timeout_s, on_replay):
    import aiohttp

    from kvshare.bench.client import model_name
    from kvshare.bench.workload import PromptFactory, WorkloadConfig
    from kvshare.engine.loader import load_tokenizer

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as session:
        model = await model_name(session, cluster.replica_urls[0])
        factory = PromptFactory(load_tokenizer(tokenizer), WorkloadConfig(nonce=f"{run_id}-{run}", seed=config.seed))
        ctx = BenchContext(run_id, session, None, model, factory, results, timeout_s=timeout_s, timeline=True)
        replayer = Replayer(ctx, cluster, trace, config)
        for rate in sorted(config.rates):
            for condition in order:
                records, row = await replayer.replay(condition, rate, run)
                results.append(records)
                with open(results.file(ROWS), "a") as f:
                    f.write(json.dumps({"run_id": run_id, **row}) + "\n")
                if on_replay is not None:
                    on_replay(row)
