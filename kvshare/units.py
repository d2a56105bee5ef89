"""Byte sizes as operators write them ("256GiB", "512M", "1.5G") and back; counts such as "100k"."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``; bare K/M/G/T are binary (as in ``free -h``), KB/MB/GB decimal."""
    match = _SIZE.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 64MiB, 16G, 1.5GiB, 1048576)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"size must be at least one byte: {text!r}")
    return int(value)


def parse_size_or_off(text: str) -> int:
    """``parse_size``, where ``0`` or ``off`` means none at all (a cache turned off)."""
    return 0 if str(text).strip().lower() in ("0", "off") else parse_size(text)


_COUNT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_count(text: str) -> int:
    """A whole count such as tokens: ``4096``, ``100k`` (x1000), ``32K`` (x1024), as vLLM reads them."""
    match = _COUNT.match(str(text))
    if not match or ("." in match.group(1) and not match.group(2)):
        raise ValueError(f"not a count: {text!r} (examples: 4096, 100k, 1.5m, 32K)")
    value = float(match.group(1)) * _COUNT_UNITS[match.group(2)]
    if value != int(value):
        raise ValueError(f"not a whole count: {text!r}")
    return int(value)


def parse_counts(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive counts, each as ``parse_count`` reads it: ``512,8k,32K`` ->
    (512, 8000, 32768)."""
    out = []
    for part in str(text).split(","):
        if not part.strip():
            continue
        value = parse_count(part)
        if value < 1:
            raise ValueError(f"counts are positive: {part.strip()!r}")
        out.append(value)
    if not out:
        raise ValueError(f"not a list of counts: {text!r} (example: 1024,8k,32k)")
    return tuple(out)


def format_bytes(num_bytes: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"
