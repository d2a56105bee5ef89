"""kvshare bench parse: rows for every length and thread count, and a clear error for bad input."""

import json

import pytest

from kvshare.bench.parse_bench import THREAD_COUNTS, ParseBenchConfig, run_parse_bench
from kvshare.cli import main


def test_rows_cover_each_length_and_thread_count():
    rows = run_parse_bench(ParseBenchConfig(lengths=(64, 5000), repeats=1))
    assert [r["tokens"] for r in rows] == [64, 5000]
    for row in rows:
        assert set(THREAD_COUNTS) <= set(row["ms_by_threads"])
        assert row["default_ms"] == row["ms_by_threads"][row["parse_threads"]]
        assert row["typed_list_ms"] > 0 and row["body_bytes"] > 0


def test_json_lines_from_the_command(capsys):
    assert main(["bench", "parse", "--lengths", "100,200", "--repeats", "1", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["tokens"] for row in lines] == [100, 200]


@pytest.mark.parametrize("kwargs", [{"lengths": ()}, {"lengths": (0,)}, {"repeats": 0}])
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        ParseBenchConfig(**kwargs)
