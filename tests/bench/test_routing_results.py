"""bench routing: invocations that share one --out make one report over all their runs.

The cluster and the replays are stand-ins (no process starts): what is checked is the folder's bookkeeping, i.e.
run numbers, which rows the report is built from, the refusal of another workload, and --summarize.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from kvshare.bench import routing
from kvshare.bench.records import Record
from kvshare.bench.routing_cluster import RoutingTarget
from kvshare.bench.routing_summary import replay_row
from kvshare.bench.routing_trace import RoutingConfig

CONDITIONS = ("round_robin/on", "pool_aware/on")


class _Cluster:
    """RoutingCluster's face as run_routing uses it, with nothing started; ``stopped`` counts its exits."""

    replica_urls = ["http://127.0.0.1:9"]
    stopped = 0

    def __init__(self, target, routers) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        _Cluster.stopped += 1


def stand_in(patch, on_replay=None) -> list[tuple[str, float, int]]:
    """run_routing with its cluster and replays stood in (``patch``: monkeypatch.setattr or setattr); each replay's
    TTFTs are (its run + 1) seconds, so a row says which run wrote it. Returns the (condition, rate, run) of every
    replay, in order; ``on_replay(count)`` is awaited before each."""
    done: list[tuple[str, float, int]] = []

    async def model_name(session, url):
        return "tiny"

    async def replay(self, condition, rate, run):
        if on_replay is not None:
            await on_replay(len(done))
        done.append((condition.name, rate, run))
        records = [
            Record("r", "routing", "u", condition.name, "measure", 100, "url", turn=turn, ttft_s=run + 1.0, e2e_s=2.0)
            for turn in (0, 1)
        ]
        return records, replay_row(f"k{run}", rate, condition.name, run, records, 1.0, 0.0, None, [])

    patch(routing, "RoutingCluster", _Cluster)
    patch(sys.modules["kvshare.bench.client"], "model_name", model_name)
    patch(routing.Replayer, "replay", replay)
    return done


@pytest.fixture
def replays(monkeypatch):
    return stand_in(monkeypatch.setattr)


def _run(out, command, first_run=None, **config):
    fields = dict(num_sessions=2, num_prompts=1, num_turns=2, rates=(1.0,), conditions=CONDITIONS, num_runs=1)
    fields.update(config)
    more = {} if first_run is None else {"first_run": first_run}
    return routing.run_routing(RoutingConfig(**fields), RoutingTarget("tiny"), str(out), command, **more)


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_two_invocations_into_one_folder_make_one_summary_over_both_runs(tmp_path, replays):
    """Fails when the report is built from the invocation's own rows (the second invocation's summary then holds
    one run), and when each invocation numbers its runs from 0 (both runs are run 0, in the same order)."""
    _run(tmp_path, "first")
    summary, report = _run(tmp_path, "second")

    assert [run for _, _, run in replays] == [0, 0, 1, 1]  # numbered on from the folder's last run
    assert [name for name, _, _ in replays] == [*CONDITIONS, *CONDITIONS[::-1]]  # the order rotates with the number
    assert {s["condition"]: s["num_runs"] for s in summary} == {name: 2 for name in CONDITIONS}
    assert all(s["ttft_first_p50"]["n"] == 2 for s in summary)  # both runs' requests pooled
    saved = _summary(tmp_path)
    assert saved["summary"] == json.loads(json.dumps(summary)) and saved["meta"]["num_runs"] == 2
    assert [m["runs"] for m in saved["invocations"]] == [[0], [1]]
    text = open(report).read()
    assert "2 invocations into this folder" in text and "`first`" in text and "`second`" in text


def test_a_run_number_given_again_replaces_that_runs_replays(tmp_path, replays):
    """Fails when a replayed (rate, condition, run) is counted twice (a command repeated after a cut)."""
    _run(tmp_path, "runs 0 and 1", num_runs=2)
    _run(tmp_path, "run 1 again", first_run=1, conditions=CONDITIONS[:1])
    summary = {s["condition"]: s for s in _summary(tmp_path)["summary"]}
    assert summary[CONDITIONS[0]]["num_runs"] == 2 and summary[CONDITIONS[0]]["ttft_first_p50"]["n"] == 2
    assert summary[CONDITIONS[1]]["num_runs"] == 2
    rows = [json.loads(line) for line in (tmp_path / "routing.jsonl").read_text().splitlines()]
    assert len(rows) == 5  # every row is kept in the file; the report counts the last of each replay
    _run(tmp_path, "run 5", first_run=5, conditions=CONDITIONS[:1])
    assert {s["condition"]: s["num_runs"] for s in _summary(tmp_path)["summary"]} == {
        CONDITIONS[0]: 3,
        CONDITIONS[1]: 2,
    }


def test_a_folder_of_another_workload_is_refused_before_any_replay(tmp_path, replays):
    """Fails when invocations of different traces are pooled into one report."""
    _run(tmp_path, "first")
    with pytest.raises(ValueError, match=r"another workload \(num_sessions: 2 there, 3 here\); give another --out"):
        _run(tmp_path, "other", num_sessions=3)
    assert len(replays) == 2
    _run(tmp_path, "other rates and conditions are fine", rates=(2.0,), conditions=("sticky/on",), num_verify=0)
    assert len(replays) == 3


def test_summarize_rebuilds_the_report_from_the_folder(tmp_path, replays, capsys):
    from kvshare.cli import main

    _run(tmp_path, "first")
    _run(tmp_path, "second")
    (tmp_path / "routing.md").unlink()
    (tmp_path / "summary.json").unlink()
    assert main(["bench", "routing", "--summarize", str(tmp_path)]) == 0
    assert [s["num_runs"] for s in _summary(tmp_path)["summary"]] == [2, 2]
    assert "2 invocations into this folder" in (tmp_path / "routing.md").read_text()
    assert main(["bench", "routing", "--summarize", str(tmp_path / "nothing")]) != 0
    assert "holds no routing.jsonl" in capsys.readouterr().err
    assert main(["bench", "routing", "--rates", "1"]) != 0
    assert "give --model" in capsys.readouterr().err


_TERMINATED = """
import asyncio, os, signal, sys
from tests.bench import test_routing_results as t

async def second_replay_is_terminated(count):
    if count == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # what `timeout` sends
        await asyncio.sleep(30)

t.stand_in(setattr, second_replay_is_terminated)
from kvshare.cli import main
code = main(["bench", "routing", "--model", "tiny", "--sessions", "2", "--prompts", "1", "--turns", "2",
             "--rates", "1", "--conditions", "round_robin/on,pool_aware/on", "--out", sys.argv[1]])
print("stopped", t._Cluster.stopped)
sys.exit(code)
"""


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_sigterm_stops_the_cluster_in_order_and_keeps_the_replays_done(tmp_path, sigint):
    """SIGTERM (what `timeout` sends a step) ends bench routing as Ctrl-C does. Fails when the command dies of the
    signal instead (status -15, its cluster never stopped: left to the kernel's parent-death signal), and, with
    SIGINT ignored (a job a script starts in the background), when SIGTERM is turned into a SIGINT that nothing
    hears (every replay then runs to its end)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)

    def start() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL)

    done = subprocess.run(
        [sys.executable, "-c", _TERMINATED, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=start,
    )
    assert done.returncode == 130, done.stdout + done.stderr
    assert "stopped 1" in done.stdout
    rows = (tmp_path / "routing.jsonl").read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["condition"] == "round_robin/on"
    assert [s["condition"] for s in _summary(tmp_path)["summary"]] == ["round_robin/on"]
