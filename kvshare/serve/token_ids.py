"""A completion's prompt of token ids read from its JSON body into one int64 array.

A prompt of 262144 token ids is ~1.9 MB of JSON, nearly all of the body. msgspec checking that list and
numpy reading it took ~13 ms of such a request's time to first token on the H200's host, before the
request's first KV copy could start. So the list is found in the body and cut out: msgspec decodes the
rest with a marker where the list stood, and numpy checks and reads the list on a few threads at once
(numpy compares arrays and reads text without the GIL)::

    body     {"model": "m", "prompt": [17, 4, 99, ...], "max_tokens": 16}
                                      ^---- the list ---^
    msgspec  {"model": "m", "prompt": "kvshare-prompt-<nonce>", "max_tokens": 16}
    numpy    17, 4, 99, ...   cut at commas into pieces, each checked as JSON and read on a thread

The marker carries a nonce drawn per process, which no client can send: msgspec handing it back as the
prompt proves that the list cut out was the request's top-level prompt. Anything else (a text prompt, a
batch, a list that is not JSON's list of non-negative integers, a "prompt" key elsewhere) returns None,
and the caller takes msgspec's generic decode, which answers any error.
"""

from __future__ import annotations

import os

import numpy as np

PROMPT_KEY = b'"prompt"'
MARK = b'"kvshare-prompt-' + os.urandom(12).hex().encode() + b'"'
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# threads reading a long prompt: 4 where there are 8 cores or more. On the H200's host (16 cores) a 131072-token
# body took 8.6 ms on one thread, 5.0 on two, 4.2 on four and 4.7 on eight (2026-12-04, commit a88001c;
# `kvshare bench parse` measures it)
PARSE_THREADS = max(1, min(4, _CORES // 2))
PARSE_PIECE_BYTES = 64 << 10  # no thread gets less text than this (~9000 token ids)
_WHITESPACE = b" \t\r\n"  # JSON's
_pool = None


def find_list(body: bytes) -> tuple[int, int] | None:
    """(index of ``[``, index of ``]``) of the first ``"prompt": [...]`` in ``body`` whose list holds no
    list; None where there is none. Whether it is the top-level prompt is msgspec's to say (``MARK``)."""
    at = body.find(PROMPT_KEY)
    if at < 0:
        return None
    i = _skip_whitespace(body, at + len(PROMPT_KEY))
    if body[i : i + 1] != b":":
        return None
    start = _skip_whitespace(body, i + 1)
    if body[start : start + 1] != b"[":
        return None
    end = body.find(b"]", start)
    if end < 0 or body.find(b"[", start + 1, end) >= 0:
        return None
    return start, end


def read_list(raw: bytes) -> np.ndarray | None:
    """A JSON list of non-negative integers (``[...]``) as one int64 array; None for any other text.

    An integer beyond int64 reads as the int64 maximum, which no vocabulary holds."""
    if raw[:1] != b"[" or raw[-1:] != b"]":
        return None
    inner = raw[1:-1]
    if not inner.strip(_WHITESPACE):
        return np.empty(0, dtype=np.int64)
    pieces = cut_at_commas(inner, min(PARSE_THREADS, len(inner) // PARSE_PIECE_BYTES))
    if len(pieces) == 1:
        return read_numbers(inner)
    parts = list(_parse_pool().map(read_numbers, pieces))
    return None if any(part is None for part in parts) else np.concatenate(parts)


def cut_at_commas(text: bytes, num: int) -> list[bytes]:
    """``text`` cut at commas (which are dropped) into at most ``num`` pieces of about equal size."""
    pieces, start = [], 0
    for i in range(1, num):
        cut = text.find(b",", max(start, len(text) * i // num))
        if cut < 0:
            break
        pieces.append(text[start:cut])
        start = cut + 1
    pieces.append(text[start:])
    return pieces


def read_numbers(text: bytes) -> np.ndarray | None:
    """``text``: JSON's non-negative integers between commas (``17, 4,99``), as int64; None for anything else
    (a sign, a fraction, a string, a missing or extra comma, ``1 2``, a leading zero).

    Elementwise checks (a few passes of ~0.05 ms over a 1.9 MB list), then numpy reads the numbers: it
    consumes number, comma, number, ... and the count proves every comma was read between two numbers."""
    chars = np.frombuffer(text, dtype=np.uint8)
    digit = (chars - np.uint8(48)) < 10  # wraps below "0"
    comma = chars == 44
    if not (digit | comma | (chars == 32) | (chars == 10) | (chars == 13) | (chars == 9)).all():
        return None
    first = digit.copy()  # each number's first digit
    first[1:] &= ~digit[:-1]
    commas = int(np.count_nonzero(comma))
    if np.count_nonzero(first) != commas + 1:  # as many numbers as commas allow, none split by whitespace
        return None
    if (first[:-1] & (chars[:-1] == 48) & digit[1:]).any():  # 01: JSON writes no leading zeros
        return None
    try:
        numbers = np.fromstring(text, dtype=np.int64, sep=",")
    except ValueError:  # text it could not read to its end (numpy >= 2.3; earlier ones warn and stop)
        return None
    return numbers if len(numbers) == commas + 1 else None


def _skip_whitespace(body: bytes, i: int) -> int:
    while i < len(body) and body[i] in _WHITESPACE:
        i += 1
    return i


def _parse_pool():
    global _pool
    if _pool is None:
        from concurrent.futures import ThreadPoolExecutor

        # threads start only as pieces need them: PARSE_THREADS of them, or up to 8 where `kvshare bench parse`
        # tries more
        _pool = ThreadPoolExecutor(8, thread_name_prefix="kvshare-parse")
    return _pool
