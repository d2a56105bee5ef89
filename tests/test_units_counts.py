"""Lists of token counts, read as every other count of kvshare is (vLLM's convention)."""

import argparse

import pytest

from kvshare.commands.bench import parse_tokens
from kvshare.units import parse_count, parse_counts


def test_a_list_of_counts_reads_each_as_one_count_does():
    assert parse_counts("512, 8k,32K,1.5m") == (512, 8000, 32768, 1_500_000)
    assert parse_counts("32K") == (parse_count("32K"),) == (32768,)
    for bad in ("", ",", "0", "8q", "1.5"):
        with pytest.raises(ValueError):
            parse_counts(bad)


def test_bench_contexts_are_that_list_and_a_bad_one_is_a_usage_error():
    assert parse_tokens("1024,8k,32K") == (1024, 8000, 32768)
    with pytest.raises(argparse.ArgumentTypeError, match="count"):
        parse_tokens("8q")
