"""Each experiment end to end against a real cluster (pool, 2 tiny-model replicas, router) on CPU.

Short contexts, few requests: what is checked is the records (provenance, output equality
between pool ON and a recompute), the report and the plots; never timings.
"""

from __future__ import annotations

import json
import os

import pytest

from kvshare.bench.blocks import BlocksConfig
from kvshare.bench.harness import Harness, HarnessConfig
from kvshare.bench.records import ResultsDir
from kvshare.bench.replicas import FixedReplicas
from kvshare.bench.sessions import SessionsConfig
from kvshare.bench.ttft import TTFTConfig
from kvshare.launch import free_port_block as free_port_base

CHUNK = 256


def reusable(n: int) -> int:
    """Prompt tokens a replica can take from a cache: whole chunks, leaving at least one token to compute."""
    return (n - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def cluster():
    from kvshare.launch import Cluster, ClusterConfig

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # two replicas on a shared 2-core machine: no thread oversubscription
        c = Cluster(
            ClusterConfig(
                num_replicas=2,
                model="tiny",
                pool_size="1GiB",
                policy="alternate",
                port=free_port_base(3),
                log_level="WARNING",
                ready_timeout_s=120,
            )
        )
        c.start()
    try:
        yield c
    finally:
        c.stop()


def run(cluster, out_dir, *configs, timeline: bool = False):
    harness = Harness(
        HarnessConfig(out_dir=str(out_dir), tokenizer="tiny", show_progress=False, timeline=timeline),
        FixedReplicas(cluster.replica_urls),
    )
    outcome = harness.run(list(configs))
    assert outcome.is_complete, outcome.runs
    return outcome, ResultsDir(str(out_dir)).load()


def assert_outputs_written(out_dir, *pngs):
    text = (out_dir / "report.md").read_text()
    assert "Beside the study" in text
    assert "Outputs that part" not in text  # float32 on CPU: every compared output equals its reference
    assert (out_dir / "records.csv").stat().st_size > 0 and (out_dir / "runs.jsonl").stat().st_size > 0
    for png in pngs:
        assert (out_dir / png).stat().st_size > 1000
    return text


def assert_reference(r, num_tokens: int) -> None:
    """A reference request carries the top-2 logprobs of each generated token (for the gap at a divergence)."""
    assert len(r.top_logprobs) == num_tokens and all(len(step) == 2 for step in r.top_logprobs)
    assert all(a >= b for a, b in r.top_logprobs) and r.output_check is None


def assert_equal_to(r, reference: str) -> None:
    assert (r.output_check, r.matches_reference, r.compared_with) == ("equal", True, reference)
    assert r.first_divergence is None and r.divergence_gap is None


def test_ttft(cluster, tmp_path):
    outcome, records = run(cluster, tmp_path, TTFTConfig(contexts=(512, 1024), repetitions=1, max_tokens=8))
    assert len(records) == 6 and all(r.is_ok for r in records)
    for r in records:
        assert r.prompt_tokens == r.context_tokens and r.completion_tokens == 8 and len(r.token_ids) == 8
        if r.condition == "cold":
            assert (r.replica, r.local_tokens, r.pool_tokens) == ("replica0", 0, 0)
        elif r.condition == "local":
            # the same prompt again: every token but the last is still in replica0's sequence KV
            assert (r.replica, r.local_tokens, r.pool_tokens) == ("replica0", r.context_tokens - 1, 0)
        else:  # cross: replica1 never saw the prompt; its prefix comes from the pool
            assert (r.replica, r.local_tokens, r.pool_tokens) == ("replica1", 0, reusable(r.context_tokens))
            assert r.cached_tokens == reusable(r.context_tokens)
        if r.condition != "cold":
            assert_equal_to(r, "cold")  # token ids equal the cold request's
        else:
            assert_reference(r, 8)
    text = assert_outputs_written(tmp_path, "ttft_by_context.png")
    assert "TTFT: cold" in text and "| equal 2/2; near-tie 0; mismatch 0 |" in text
    with open(tmp_path / "records.csv") as f:
        header = f.readline()
    assert "output_check" in header and "divergence_gap" in header and "top_logprobs" not in header
    assert all(r.timeline is None for r in records)  # not asked for
    # a second run resumes: everything is recorded, nothing is sent again
    outcome, again = run(cluster, tmp_path, TTFTConfig(contexts=(512, 1024), repetitions=1, max_tokens=8))
    assert outcome.runs["ttft"].num_skipped == 2 and outcome.runs["ttft"].num_done == 0 and len(again) == 6


def test_records_keep_the_timeline_when_asked(cluster, tmp_path):
    _, records = run(cluster, tmp_path, TTFTConfig(contexts=(600,), repetitions=1, max_tokens=4), timeline=True)
    assert len(records) == 3
    for r in records:
        t = r.timeline
        assert t is not None and t["first_token_sampled"] <= t["published"], t
        assert (t["load_end"] is not None) == (r.condition == "cross"), (r.condition, t)
    with open(tmp_path / "records.csv") as f:
        assert "timeline" not in f.readline()


def test_blocks(cluster, tmp_path):
    _, records = run(cluster, tmp_path, BlocksConfig(contexts=(1024,), per_block=2, max_tokens=8, verify=1))
    assert all(r.is_ok for r in records)
    measured = [r for r in records if r.role == "measure"]
    assert [(r.block, r.condition) for r in measured] == [(0, "off")] * 2 + [(1, "on")] * 2 + [(2, "on")] * 2 + [
        (3, "off")
    ] * 2
    for r in measured:
        assert r.replica == "replica1" and r.local_tokens == 0
        assert r.pool_tokens == (reusable(1024) if r.condition == "on" else 0)
    primes = [r for r in records if r.role == "prime"]
    assert len(primes) == 4 and all(r.replica == "replica0" and r.computed_tokens == 1024 for r in primes)
    (verify,) = [r for r in records if r.role == "verify"]
    assert (verify.replica, verify.local_tokens, verify.pool_tokens) == ("replica1", 0, 0)
    assert_reference(verify, 8)
    # ON outputs equal a recompute (the verify request, else the prime of the same prompt)
    for r in measured:
        if r.condition == "on":
            assert_equal_to(r, "verify" if (r.block, r.position) == (verify.block, verify.position) else "prime")
    assert_equal_to([p for p in primes if (p.block, p.position) == (verify.block, verify.position)][0], "verify")
    text = assert_outputs_written(tmp_path, "ttft_by_context.png")
    assert "Blocked design" in text and "| 1024 | 4 |" in text


def test_sessions(cluster, tmp_path):
    config = SessionsConfig(
        contexts=(1024,),
        num_sessions=1,
        num_turns=3,
        turn_tokens=64,
        answer_tokens=8,
        verify=1,
        routers=(("alternate", cluster.router_url),),
    )  # alternate through the real router
    _, records = run(cluster, tmp_path, config)
    assert all(r.is_ok for r in records)
    turns = {
        c: [r for r in records if r.condition == c and r.role == "measure"]
        for c in ("alternate/off", "alternate/on", "sticky/off", "sticky/on")
    }
    assert all([r.turn for r in t] == [0, 1, 2] for t in turns.values())
    assert [r.replica for r in turns["alternate/on"]] == ["replica0", "replica1", "replica0"]
    assert [r.replica for r in turns["alternate/off"]] == ["replica0", "replica1", "replica0"]
    assert len({r.replica for r in turns["sticky/on"]}) == 1 and len({r.replica for r in turns["sticky/off"]}) == 1
    # history grows turn by turn: each prompt longer than the last by answer + new user message
    for t in turns.values():
        assert t[0].prompt_tokens == 1024 and t[0].prompt_tokens < t[1].prompt_tokens < t[2].prompt_tokens
    # alternate ON: turn 1 on replica1 takes turn 0's prompt from the pool; OFF never touches the pool
    assert turns["alternate/on"][1].pool_tokens >= reusable(1024)
    assert all(r.pool_tokens == 0 for c in ("alternate/off", "sticky/off") for r in turns[c])
    assert turns["alternate/off"][1].local_tokens == 0 and turns["alternate/off"][2].local_tokens >= reusable(1024)
    # sticky: the replica's own cache holds the history already
    assert turns["sticky/on"][1].local_tokens >= reusable(1024) and turns["sticky/on"][1].pool_tokens == 0
    verifies = [r for r in records if r.role == "verify"]
    assert len(verifies) == 2 and all(v.pool_tokens == 0 and v.local_tokens == 0 for v in verifies)
    for v in verifies:
        assert_reference(v, 8)
    for c, t in turns.items():
        if c.endswith("/on"):
            assert_equal_to(t[-1], "verify")
    text = assert_outputs_written(tmp_path, "session_turns.png")
    assert "Multi-turn sessions" in text and "Per-turn TTFT" in text


def test_cli_against_running_replicas(cluster, tmp_path):
    from kvshare.cli import main

    out = tmp_path / "cli"
    argv = [
        "--log-level",
        "WARNING",
        "bench",
        "ttft",
        "--contexts",
        "600",
        "--repetitions",
        "1",
        "--max-tokens",
        "4",
        "--out",
        str(out),
        "--no-progress",
    ] + sum((["--replica", u] for u in cluster.replica_urls), [])
    assert main(argv) == 0
    assert_outputs_written(out, "ttft_by_context.png")
    assert main(["bench", "report", "--out", str(out)]) == 0


def test_cli_ttft_with_a_users_text_client(cluster, tmp_path):
    """`kvshare bench ttft --client text`: chat text through a user's client, every request paired with its
    prompt as token ids under the same condition; text rows carry text_overhead, the tables a row per client."""
    from kvshare.cli import main

    out = tmp_path / "text"
    argv = [
        "--log-level",
        "WARNING",
        "bench",
        "ttft",
        "--client",
        "text",
        "--contexts",
        "600",
        "--repetitions",
        "2",
        "--max-tokens",
        "4",
        "--out",
        str(out),
        "--no-progress",
    ]
    argv += sum((["--replica", u] for u in cluster.replica_urls), [])
    assert main(argv) == 0
    records = ResultsDir(str(out)).load()
    assert len(records) == 12 and all(r.is_ok for r in records)
    assert sorted({(r.condition, r.client) for r in records}) == sorted(
        (c, k) for c in ("cold", "local", "cross") for k in ("text", "token_ids")
    )
    for r in records:
        assert r.prompt_tokens == 600 and r.completion_tokens == 4  # the rendered chat: exactly the asked length
        if r.condition == "cold":
            assert (r.replica, r.local_tokens, r.pool_tokens) == ("replica0", 0, 0)  # the pair's second too
        elif r.condition == "cross":  # the pair's second ignores what the first left in replica1's local cache
            assert (r.replica, r.local_tokens, r.pool_tokens) == ("replica1", 0, reusable(600))
        if (r.condition, r.client) != ("cold", "text"):
            assert_equal_to(r, "cold")  # text and token ids give the same output
        assert (r.text_overhead is not None) == (r.client == "text")
    text = (out / "report.md").read_text()
    assert "| 600 | text |" in text and "| 600 | token_ids |" in text
    run_info = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert run_info[-1]["config"]["client"] == "text" and run_info[-1]["user_client"].startswith(("openai", "aiohttp"))


def test_demo_hook(cluster, tmp_path, capsys):
    from kvshare.bench.demo_experiments import run_demo_experiments

    outcome = run_demo_experiments(cluster, str(tmp_path), scale="smoke", show_progress=False)
    assert outcome.is_complete and set(outcome.runs) == {"ttft", "blocks", "sessions"}
    assert os.path.exists(outcome.report_path)
    printed = capsys.readouterr().out
    assert "Beside the study" in printed and "Blocked design" in printed


def test_blocks_with_sequential_replicas(tmp_path):
    """The GPU set-up on CPU: one pool, replica A primes and is stopped, then B starts and is measured."""
    from kvshare.bench.replicas import SequentialConfig, SequentialReplicas

    replicas = SequentialReplicas(
        SequentialConfig(
            model="tiny",
            pool_size="512MiB",
            port=free_port_base(2),
            log_dir=str(tmp_path / "logs"),
            ready_timeout_s=120,
        )
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        replicas.start()
        try:
            harness = Harness(HarnessConfig(out_dir=str(tmp_path), show_progress=False), replicas)
            outcome = harness.run(
                [BlocksConfig(contexts=(600,), per_block=1, design=("on", "off"), max_tokens=4, verify=0)]
            )
        finally:
            replicas.close()
    assert outcome.is_complete
    records = ResultsDir(str(tmp_path)).load()
    assert [(r.block, r.role, r.replica) for r in records] == [
        (0, "prime", "replica0"),
        (0, "measure", "replica1"),
        (1, "measure", "replica1"),
    ]
    on, off = records[1], records[2]
    assert on.pool_tokens == reusable(600) and on.local_tokens == 0
    assert_equal_to(on, "prime")
    assert off.pool_tokens == 0 and off.computed_tokens == 600
    # B was started once, after A was stopped (prime on A, then B for both blocks)
    assert len(replicas.start_seconds) == 2
