"""Sizes where 0 or "off" turns a cache off."""

import pytest

from kvshare.units import parse_size_or_off


def test_zero_and_off_mean_none_other_sizes_parse_as_sizes():
    assert parse_size_or_off("0") == 0 and parse_size_or_off("off") == 0 and parse_size_or_off(" OFF ") == 0
    assert parse_size_or_off("1GiB") == 1 << 30
    with pytest.raises(ValueError):
        parse_size_or_off("none")
