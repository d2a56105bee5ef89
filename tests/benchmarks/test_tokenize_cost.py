"""benchmarks/tokenize_cost.py --fresh: a replica's rows name each request and step, with serve's chat ids (in
process, the tiny preset's tokenizer: no child processes), and the summary compares first and steady alike."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.loader import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("tokenize_cost")


def test_a_fresh_replica_reports_every_request_step_by_step(bench, tmp_path, capsys):
    """Fails when a replica's rows lose a request or a step, or the summary's ratio is not of its medians."""
    chats = [[{"role": "user", "content": f"text {k}: " + "words and more words " * 50}] for k in range(3)]
    bodies = tmp_path / "bodies.json"
    bodies.write_text(json.dumps([json.dumps({"model": "m", "messages": c, "max_tokens": 16}) for c in chats]))
    bench.fresh_replica("tiny", str(bodies), str(tmp_path / "share"), is_warm=True)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["request"] for r in rows] == list(bench.FRESH_REQUESTS)
    assert all(r["warm"] and r["tokens"] > 1000 for r in rows)
    assert all(r[f"{s}_ms"] >= 0 for r in rows for s in (*bench.STEPS, "total"))
    bench.summarize([{"tree": "this", **r} for r in rows], 131072, is_json=True)
    summary = json.loads(capsys.readouterr().out)
    first, steady = summary["median_1st_cross_ms"], summary["median_2nd_cross_ms"]
    assert summary["first_over_steady"] == round(first / steady, 2) and summary["budget_ms"] == 19.1


def test_every_path_of_a_length_is_timed_and_the_routers_ids_are_the_replicas(bench, monkeypatch, capsys):
    """Fails when a path's row loses its figures (the router's placement read among them) or when measure's check
    that the router reads the replica's ids is dropped (it raises on a difference)."""
    monkeypatch.setattr(
        "sys.argv", ["tokenize_cost", "--model", "tiny", "--lengths", "2048", "--repeats", "1", "--json"]
    )
    assert bench.main() == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    paths = ("plain", "first", "first_shared", "other", "again", "next_turn", "router")
    assert row["tokens"] == 2048 and all(row[f"{p}_ms"] > 0 for p in paths)
